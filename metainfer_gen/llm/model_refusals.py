"""Engine features a model refuses, by its own attributes: the engine asks here and falls back, logged and audited.

A model class may say why it cannot use a feature yet with a class attribute (a sentence, or absent / None):
``prefix_caching_refusal`` (the block manager then registers no prefixes) and ``static_decode_refusal`` (decode
steps then run eager: no static buffers, CUDA graphs or compiled graph; ``compiled_decode`` audits the same reason).
DeepSeek-V4 sets both from its family's ``refuses`` (:mod:`metainfer_gen.llm.models.families`, which ``doctor``
prints too). Plain Python, no device work.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

AUDIT_OP, AUDIT_SITE = "prefix_cache", "llm.engine"


def prefix_caching_allowed(model, enabled: bool) -> bool:
    """``enabled``, unless ``model`` refuses prefix caching; refusing an enabled cache is logged and audited (op
    :data:`AUDIT_OP`, site :data:`AUDIT_SITE`: path "off", the refused "on" with the model's reason)."""
    refusal = getattr(model, "prefix_caching_refusal", None)
    if not enabled or refusal is None:
        return enabled
    from metainfer_gen.kernels.audit_log import Refusal, record

    log.info("prefix caching off: %s", refusal)
    record(AUDIT_OP, AUDIT_SITE, "off", (Refusal("on", refusal),))
    return False


def static_decode_allowed(model) -> bool:
    """False (logged) for a model that refuses static / compiled decode steps."""
    refusal = getattr(model, "static_decode_refusal", None)
    if refusal is not None:
        log.info("decode steps run eager: %s", refusal)
    return refusal is None
