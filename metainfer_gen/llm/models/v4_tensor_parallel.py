"""Which DeepSeek-V4 dimensions tensor parallelism splits, and the refusal of a size that does not divide them.

Split (each rank holds ``1 / size`` of it): the attention heads (``q_b_proj``'s rows, the per-head ``sinks``), the
grouped output projection by whole ``o_groups`` (``o_a_proj`` is block-diagonal, one block a group, so a rank's
heads feed only its own groups; ``o_b_proj`` row-parallel, summed over the group), the shared expert's
``intermediate_size`` columns, the routed experts (whole experts, contiguous ranges as DeepSeek-V3's MoE) and the
vocabulary (embedding and head, the last shard zero-padded). Replicated on every rank: the 512-wide K=V head
(``kv_proj``, ``kv_norm``), the compressors and the CSA indexer (their outputs are per token, not per head; the
indexer's own heads are summed before its top-k), hyper-connections, norms and routers. Plain Python, no torch:
the engine refuses an indivisible size from config.json alone, before any process group or weight.
"""

from __future__ import annotations


def v4_split_sizes(config) -> dict[str, int]:
    """The dimensions split over ranks that must divide exactly, by their config names."""
    return {"num_attention_heads": config.num_attention_heads, "o_groups": config.o_groups,
            "intermediate_size": config.intermediate_size}


def check_v4_tensor_parallel(config, size: int) -> None:
    """Refuse a tensor-parallel ``size`` the DeepSeek-V4 ``config`` (a transformers ``DeepseekV4Config``) cannot
    be split over.

    Raises:
        ValueError: a split dimension (:func:`v4_split_sizes`) not divisible by ``size``, or fewer routed experts
            than ranks; the message names every such dimension and the sizes that would divide them.
    """
    if size == 1:
        return
    sizes, experts = v4_split_sizes(config), config.n_routed_experts
    problems = [f"{name}={value} is not divisible by it" for name, value in sizes.items() if value % size]
    if experts < size:
        problems.append(f"n_routed_experts={experts} is below it (a rank would hold no expert)")
    if not problems:
        return
    fits = [s for s in range(2, max(sizes.values()) + 1) if all(v % s == 0 for v in sizes.values()) and experts >= s]
    raise ValueError(f"deepseek_v4 cannot be split over tensor_parallel_size={size}: {'; '.join(problems)} "
                     f"(heads, whole output groups and the shared expert's columns are split over the ranks); use "
                     f"tensor_parallel_size in {[1, *fits]}")
