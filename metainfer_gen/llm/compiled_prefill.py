"""A compiled prefill step on the CPU: every step with prompt tokens runs the model as one Inductor graph over a
symbolic token count.

A step that prefills (prompt chunks, alone or beside decode rows: the unified scheduler mixes them) has a
different token count almost every time, so :mod:`metainfer_gen.llm.compiled_decode`'s one graph per batch size
does not fit it. Its model forward is compiled once with the token dimension dynamic
(``torch._dynamo.mark_dynamic``), frozen as the decode graphs are (``COMPILE_CONFIG``):

- the norms, rotary, routing, SwiGLU products, residual adds and casts of every layer fuse into C++ loops over
  all the step's tokens, and the step's Python (over a thousand aten calls) becomes one graph call;
- each layer's cache write and attention are one opaque op (``metainfer::mla_store_attend``,
  :mod:`metainfer_gen.llm.graph_ops`) that runs the eager kernels over the step's own
  :class:`~metainfer_gen.llm.attention_metadata.AttentionMetadata`, read from a step context (vLLM's attention op
  reads its forward context the same way); the routed experts are the opaque expert op. The graph traces the
  model with a stand-in metadata (``deferred=True``) that holds only the per-token tensors, so no per-sequence
  list is frozen into it, and nothing in it branches on the token count (one graph admits every count >= 2).

The graph is built by the engine's warm-up (its full-budget prefill step, inside :meth:`CompiledPrefill.building`);
afterwards it runs with ``torch._dynamo.run`` (cached graphs only, never a compile), and a step its guards do not
admit runs the same forward eagerly, audited. Steps of one token are decode steps and never come here.

On 2 Zen 4 cores (AVX512-BF16, no AMX), compiled and eager prefill alternated in one process on serve_llm.py's
random DeepSeek-V3: one prompt of 64 / 128 / 256 / 512 tokens took 28.6 / 44.7 / 68.1 / 147.6 ms against 31.5 /
47.4 / 69.3 / 161.5 ms in float32 and 15.4 / 22.6 / 36.7 / 73.1 ms against 17.4 / 25.1 / 39.8 / 74.9 ms in bf16
(medians of 5); in batches of thousands of tokens the step is bound by its GEMMs and attention and the graph
gains 0-9%.

Where it applies: :func:`metainfer_gen.llm.compiled_decode.compiled_decode_refusal` (the same refusals; audit
op ``prefill_step``, site ``llm.prefill``).
"""

from __future__ import annotations

import torch

from metainfer_gen.kernels.audit_log import Refusal, record
from metainfer_gen.llm import graph_ops
from metainfer_gen.llm.attention_metadata import AttentionMetadata
from metainfer_gen.llm.compiled_decode import COMPILE_CONFIG, PREFILL_SITE as _SITE, BuildWindow, own_code


class CompiledPrefill(BuildWindow):
    """The model forward of steps with prompt tokens, ``torch.compile``'d once with a dynamic token count.

    Args:
        model: the engine model (``forward(input_ids, meta, kv_caches)``); its attention layers are the
            ``MLAttention`` modules (``layer_idx`` -> module), which ``metainfer::mla_store_attend`` calls.
        kv_caches: the runner's per-layer caches (written in place by the graph).
    """

    def __init__(self, model, kv_caches: list[torch.Tensor]):
        from metainfer_gen.llm.layers.mla import MLAttention

        self.model = model
        self.kv_caches = kv_caches
        self.layers = {m.layer_idx: m for m in model.modules() if isinstance(m, MLAttention)}
        forward = own_code(self._forward)  # this engine's own dynamo cache (another engine has other weights)
        self._graph = torch.compile(forward, options={
            "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe})
        self._run_cached = torch._dynamo.run(forward)  # the same code's cached graphs only, never a compile
        self.built = False  # the graph is compiled (by the warm-up's first prefill step, in building())
        self._ran_eager = False
        self.num_compiled_steps = 0  # steps the graph ran (for tests and logs)

    def __call__(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """input_ids (T,) int64, ``meta`` of the step -> hidden (T, hidden) in the model dtype; writes the step's
        KV. Compiled when the graph is built (or being built) and admits the step, eager otherwise (audited)."""
        if not self.built and not self._building:
            record("prefill_step", _SITE, "eager", (Refusal("compiled", "no compiled prefill graph yet: it is "
                                                                        "built by LLMEngine.warmup()"),))
            return self.model(input_ids, meta, self.kv_caches)
        tensors = (input_ids, meta.positions, meta.slot_mapping)
        for tensor in tensors:
            torch._dynamo.mark_dynamic(tensor, 0)
        self._ran_eager = False
        with graph_ops.step_context(meta, self.layers):
            if self.built:
                hidden = self._run_cached(*tensors)
            else:
                import torch._inductor.config as inductor_config

                with inductor_config.patch(COMPILE_CONFIG):
                    hidden = self._graph(*tensors)
                self.built = True
        self.num_compiled_steps += not self._ran_eager
        return hidden

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
        """Traced: the model over a stand-in metadata that holds only the per-token tensors (attention reads the
        step's own through the step context). Run eager (a step the graph's guards refuse): the step's metadata."""
        if not torch.compiler.is_compiling():
            meta, self._ran_eager = graph_ops.current_step()[0], True
            record("prefill_step", _SITE, "eager", (Refusal("compiled", f"the graph's guards refused a step of "
                                                                        f"{input_ids.shape[0]} tokens"),))
            return self.model(input_ids, meta, self.kv_caches)
        none = positions.new_empty(0)
        meta = AttentionMetadata(positions=positions, slot_mapping=slot_mapping, query_lens=[], starts=[],
                                 context_lens=[], query_offsets=[], decode_rows=[], decode_tokens=none,
                                 prefill_rows=[], prefill_slots=[], decode_block_tables=none.view(0, 1),
                                 decode_context_lens=none, block_size=0, deferred=True)
        return self.model(input_ids, meta, self.kv_caches)
