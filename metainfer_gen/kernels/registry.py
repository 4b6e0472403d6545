"""Dispatch by op name to the fastest implementation that applies, with the refusals audited.

Each op holds implementations ordered fastest first. An implementation pairs a function with a ``supports``
predicate taking the same arguments and returning ``None`` when it applies or a refusal reason when it does not
(``"dtype torch.float64 not in (float32, bfloat16, float16)"``, ``"input x is not contiguous"``, ``"CPU-only
machine: ..."``). Dispatch walks the list, runs the first that applies, and records the choice and every refusal in
:mod:`metainfer_gen.kernels.audit_log`, counted per call site. The decision is cached per input signature
(:mod:`metainfer_gen.kernels.dispatch_cache`), so a hot op pays a dictionary lookup, not the predicates; every call
is still counted in the audit with the path and the refusals. In strict mode -- ``strict=True`` or the environment
variable ``METAINFER_STRICT_FAST_PATH=1`` -- any refusal raises :class:`FastPathRefused` instead of falling back.

Under ``torch.compile`` (an outer compile of a whole model) dispatch runs the last implementation, the plain torch
reference, unaudited: it traces cleanly and the outer compiler fuses it anyway.

Kernel modules register their ops here on import (:func:`register_op`); :mod:`metainfer_gen.kernels.catalog`
knows the built-in kernel modules and looks ops up by name (this module imports none of them).
The design follows mini-sglang's lazy registries and vLLM's ``CustomOp`` (``forward_cuda`` / ``forward_native``
chosen per platform), with the difference that the choice is made per call from the inputs and always reported.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable

from metainfer_gen.kernels.audit_log import Refusal, record

__all__ = [
    "FastPathRefused",
    "Implementation",
    "Op",
    "STRICT_ENV",
    "register_op",
    "strict_enabled",
]

STRICT_ENV = "METAINFER_STRICT_FAST_PATH"

Example = Callable[[str, Any], tuple[tuple, dict]]


class FastPathRefused(RuntimeError):
    """Strict mode: a faster implementation did not apply. ``refusals`` lists each one and why."""

    def __init__(self, op: str, site: str, path: str, refusals: tuple[Refusal, ...]):
        self.op, self.site, self.path, self.refusals = op, site, path, refusals
        reasons = "; ".join(str(r) for r in refusals)
        super().__init__(f"{op} at {site} would fall back to '{path}' ({STRICT_ENV}/strict is on): {reasons}")


def strict_enabled(strict: bool | None = None) -> bool:
    """``strict`` when given, else the ``METAINFER_STRICT_FAST_PATH`` environment variable (``1``/``true``/``yes``)."""
    if strict is not None:
        return bool(strict)
    return os.environ.get(STRICT_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def _always(*args: Any, **kwargs: Any) -> None:
    return None


def _device_type(args: tuple, kwargs: dict) -> str | None:
    """The device type of the first tensor among the arguments, None when there is none."""
    import torch

    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value.device.type
    return None


@dataclass(frozen=True, slots=True)
class Implementation:
    """One way to compute an op. ``supports(*args, **kwargs)`` -> None (applies) or the refusal reason.

    ``devices``: the device types it is built for (``("cpu",)`` for a oneDNN or C++ kernel), None for any. On
    inputs of another device type it is not a path this machine could take, so dispatch passes over it without a
    refusal (cuBLAS running a GPU linear is the fast path there, not a fallback from a CPU kernel).
    """

    name: str
    fn: Callable[..., Any]
    supports: Callable[..., str | None] = _always
    description: str = ""
    devices: tuple[str, ...] | None = None

    def built_for(self, device_type: str | None) -> bool:
        """True when this implementation is built for ``device_type`` (None: unknown, counts as built for)."""
        return self.devices is None or device_type is None or device_type in self.devices

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)


class Op:
    """A named operation with implementations ordered fastest first; the last must always apply.

    Args:
        name: registry key (``"rms_norm"``).
        description: one line for ``doctor``.
        example: ``example(device, dtype) -> (args, kwargs)`` building representative inputs, so that ``doctor``
            can report which implementation would run on this machine without running anything.
    """

    def __init__(self, name: str, description: str = "", example: Example | None = None):
        if not name or not isinstance(name, str):
            raise ValueError(f"op name must be a non-empty string; got {name!r}")
        self.name = name
        self.description = description
        self.example = example
        self._impls: list[Implementation] = []
        self._decisions: dict[tuple, tuple[Implementation, tuple[Refusal, ...]]] = {}
        self._decision_env: tuple | None = None

    def register(self, name: str, fn: Callable[..., Any], supports: Callable[..., str | None] | None = None, *,
                 description: str = "", before: str | None = None,
                 devices: tuple[str, ...] | None = None) -> Implementation:
        """Add an implementation at the end (the slowest so far) or just before the one named ``before``;
        ``devices`` names the device types it is built for (see :class:`Implementation`), None for any.

        Raises:
            ValueError: ``name`` already registered for this op, or ``before`` unknown.
        """
        if any(i.name == name for i in self._impls):
            raise ValueError(f"{self.name}: implementation {name!r} already registered")
        impl = Implementation(name, fn, supports or _always, description, devices)
        if before is None:
            self._impls.append(impl)
        else:
            self._impls.insert(self._index(before), impl)
        self._decisions.clear()
        return impl

    def _index(self, name: str) -> int:
        for k, impl in enumerate(self._impls):
            if impl.name == name:
                return k
        raise ValueError(f"{self.name} has no implementation {name!r}; registered: {self.names}")

    @property
    def names(self) -> list[str]:
        return [i.name for i in self._impls]

    @property
    def implementations(self) -> tuple[Implementation, ...]:
        return tuple(self._impls)

    def implementation(self, name: str) -> Implementation:
        """The implementation called ``name`` (to call it directly in tests and benchmarks, bypassing dispatch)."""
        return self._impls[self._index(name)]

    def fastest_for(self, device_type: str) -> str:
        """The name of the fastest implementation built for ``device_type`` (the one dispatch runs when it
        applies)."""
        return next(i.name for i in self._impls if i.built_for(device_type))

    @property
    def reference(self) -> Implementation:
        """The last implementation: plain torch, always applicable, the ground truth for tests."""
        return self._impls[-1]

    def select(self, *args: Any, **kwargs: Any) -> tuple[Implementation, tuple[Refusal, ...]]:
        """The implementation dispatch would run for these inputs, and the refusals of the faster ones; those built
        for another device type than the first tensor argument's are passed over unrecorded.

        Raises:
            RuntimeError: no implementation applies (a registration bug: the last one should always apply).
        """
        refusals: list[Refusal] = []
        device_type = _device_type(args, kwargs)
        for impl in self._impls:
            if not impl.built_for(device_type):
                continue
            reason = impl.supports(*args, **kwargs)
            if reason is None:
                return impl, tuple(refusals)
            refusals.append(Refusal(impl.name, reason))
        raise RuntimeError(f"{self.name}: no implementation applies: " + "; ".join(str(r) for r in refusals))

    def decide(self, *args: Any, **kwargs: Any) -> tuple[Implementation, tuple[Refusal, ...]]:
        """:meth:`select`, cached per input signature (see :mod:`metainfer_gen.kernels.dispatch_cache`).

        The cache is dropped when the machine state changes (capabilities override, ``TRITON_INTERPRET``, triton
        installed or not), when it reaches ``MAX_DECISIONS`` entries, and by :meth:`clear_decisions` (after
        registering an implementation, or for a predicate that reads state the signature does not capture).
        """
        from metainfer_gen.kernels import dispatch_cache

        key = dispatch_cache.signature_key(args, kwargs)
        if key is None:
            return self.select(*args, **kwargs)
        env = dispatch_cache.environment()
        if env != self._decision_env:
            self._decisions.clear()
            self._decision_env = env
        decision = self._decisions.get(key)
        if decision is None:
            decision = self.select(*args, **kwargs)
            if len(self._decisions) >= dispatch_cache.MAX_DECISIONS:
                self._decisions.clear()
            self._decisions[key] = decision
        return decision

    def clear_decisions(self) -> None:
        """Forget the cached decisions (the next call of each signature walks the predicates again)."""
        self._decisions.clear()

    def dispatch(self, *args: Any, site: str | None = None, strict: bool | None = None, stacklevel: int = 1,
                 **kwargs: Any) -> Any:
        """Run the fastest applicable implementation and audit the choice.

        The choice comes from :meth:`decide` (cached per input signature), and every call is still counted in the
        audit with its site, the path that ran and the faster paths refused, exactly as a fresh :meth:`select`
        would report them.

        Args:
            args, kwargs: the op's arguments, passed to ``supports`` and to the implementation.
            site: the call-site name in the audit (pass a constant from hot code); default
                ``"file.py:line (function)"`` of the caller ``stacklevel`` frames up (1 = whoever called
                ``dispatch``), looked up in a per-code-object cache.
            strict: raise instead of falling back; None reads ``METAINFER_STRICT_FAST_PATH``.
        Raises:
            FastPathRefused: strict mode and a faster implementation was refused.
        """
        import torch

        if torch.compiler.is_compiling():
            return self._impls[-1].fn(*args, **kwargs)
        impl, refusals = self.decide(*args, **kwargs)
        if site is None:
            from metainfer_gen.kernels.dispatch_cache import call_site

            site = call_site(stacklevel)
        if refusals and strict_enabled(strict):
            raise FastPathRefused(self.name, site, impl.name, refusals)
        record(self.name, site, impl.name, refusals)
        return impl.fn(*args, **kwargs)

    def __repr__(self) -> str:
        return f"Op({self.name!r}, implementations={self.names})"


_OPS: dict[str, Op] = {}  # name -> op, in registration order (read by kernels.catalog)


def register_op(op: Op) -> Op:
    """Add ``op`` to the registry.

    Raises:
        ValueError: another op already has this name.
    """
    existing = _OPS.get(op.name)
    if existing is not None and existing is not op:
        raise ValueError(f"op {op.name!r} is already registered")
    _OPS[op.name] = op
    return op
