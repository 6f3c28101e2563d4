"""Discovery and selection of backends and kernel implementations.

Both come from entry points, read through stevedore:

- ``flashloop_backend.backends``: name -> zero-argument callable returning a ``BackendSpec``;
- ``flashloop_backend.kernels``: name -> zero-argument callable returning a ``KernelProvider``.

A plugin that fails to import, or two distributions claiming one name with different
targets, never crash discovery: they become reasons reported wherever that name is asked
for. Explicit selection never falls back; ``auto`` walks the priority list and records why
every other candidate was skipped.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from stevedore import ExtensionManager

from flashloop_backend._version import __version__
from flashloop_backend.capabilities import (
    Capability,
    Environment,
    SupportRequest,
    not_supported_reasons,
)
from flashloop_backend.config import ConfigError, EffectiveConfig, FlashLoopConfig, UnservableError
from flashloop_backend.kernels.op_protocols import OpName
from flashloop_backend.kernels.ops import KernelImpl, KernelProvider
from flashloop_backend.registry.spec import BackendSpec, BuiltBackend, SelectionInfo

LOG = logging.getLogger("flashloop_backend")
BACKEND_GROUP = "flashloop_backend.backends"
KERNEL_GROUP = "flashloop_backend.kernels"
AUTO = "auto"


@dataclass(frozen=True)
class LoadFailure:
    group: str
    name: str
    target: str
    error: str

    def reason(self) -> str:
        return f"plugin {self.name!r} ({self.target}) failed to load: {self.error}"


@dataclass(frozen=True)
class KernelChoice:
    op: OpName
    provider: KernelProvider
    impl: KernelImpl
    reason: str


@dataclass(frozen=True)
class BackendSelection:
    spec: BackendSpec
    info: SelectionInfo
    rejected: Mapping[str, list[str]] = field(default_factory=dict)


class Registry:
    """Installed backends and kernel providers, plus everything that failed to load."""

    def __init__(
        self,
        backends: Mapping[str, BackendSpec],
        kernels: Mapping[str, KernelProvider],
        failures: Iterable[LoadFailure] = (),
        env: Environment | None = None,
    ) -> None:
        self.backends = dict(backends)
        self.kernels = dict(kernels)
        self.failures = {(f.group, f.name): f for f in failures}
        self.env = env or Environment.detect()

    # ---------------------------------------------------------------- discovery
    @classmethod
    def discover(cls, env: Environment | None = None, refresh: bool = False) -> Registry:
        """Read both entry-point groups. ``refresh`` rereads plugins installed since start."""
        backends, backend_failures = _load_group(BACKEND_GROUP, refresh)
        kernels, kernel_failures = _load_group(KERNEL_GROUP, refresh)
        specs: dict[str, BackendSpec] = {}
        failures = backend_failures + kernel_failures
        for name, (target, factory) in backends.items():
            obj = _call_factory(BACKEND_GROUP, name, target, factory, BackendSpec, failures)
            if obj is not None:
                specs[name] = obj
        providers: dict[str, KernelProvider] = {}
        for name, (target, factory) in kernels.items():
            obj = _call_factory(KERNEL_GROUP, name, target, factory, KernelProvider, failures)
            if obj is not None:
                providers[name] = obj
        return cls(specs, providers, failures, env)

    def backend_names(self) -> list[str]:
        return sorted(set(self.backends) | {n for g, n in self.failures if g == BACKEND_GROUP})

    def kernel_names(self) -> list[str]:
        return sorted(set(self.kernels) | {n for g, n in self.failures if g == KERNEL_GROUP})

    # ---------------------------------------------------------------- kernels
    def kernel_reasons(self, name: str, op: OpName, request: SupportRequest) -> list[str]:
        """Why kernel provider ``name`` cannot serve ``op`` for ``request`` here."""
        failure = self.failures.get((KERNEL_GROUP, name))
        if failure is not None:
            return [failure.reason()]
        if name not in self.kernels:
            installed = self.kernel_names()
            return [f"kernel implementation {name!r} is not installed (installed: {installed})"]
        impl = self.kernels[name].impls.get(op)
        if impl is None:
            provided = sorted(o.value for o in self.kernels[name].impls)
            return [f"{name!r} does not implement op {op.value!r} (it implements {provided})"]
        return not_supported_reasons(impl.support, request, self.env)

    def select_kernel(
        self, op: OpName, request: SupportRequest, override: str | None = None
    ) -> KernelChoice:
        """The implementation of ``op`` to use. An override never falls back."""
        if override is not None:
            reasons = self.kernel_reasons(override, op, request)
            if reasons:
                raise ValueError(
                    f"kernel override {op.value}={override!r} cannot serve this request: "
                    + "; ".join(reasons)
                )
            provider = self.kernels[override]
            return KernelChoice(op, provider, provider.impls[op], "named by kernel_overrides")
        rejected: dict[str, list[str]] = {}
        for name in self._kernel_priority(op):
            reasons = self.kernel_reasons(name, op, request)
            if not reasons:
                provider = self.kernels[name]
                why = "highest-priority usable implementation"
                if rejected:
                    why += "; skipped " + "; ".join(
                        f"{n}: {', '.join(r)}" for n, r in rejected.items()
                    )
                return KernelChoice(op, provider, provider.impls[op], why)
            rejected[name] = reasons
        for (group, name), failure in self.failures.items():
            if group == KERNEL_GROUP:
                rejected[name] = [failure.reason()]
        detail = "; ".join(f"{n}: {', '.join(r)}" for n, r in rejected.items()) or "none installed"
        raise ValueError(f"no kernel implementation can serve op {op.value!r}: {detail}")

    def _kernel_priority(self, op: OpName) -> list[str]:
        providers = [p for p in self.kernels.values() if op in p.impls]
        providers.sort(key=lambda p: (-p.priority, p.name))
        return [p.name for p in providers]

    # ---------------------------------------------------------------- backends
    def backend_reasons(
        self, name: str, request: SupportRequest, config: FlashLoopConfig
    ) -> list[str]:
        failure = self.failures.get((BACKEND_GROUP, name))
        if failure is not None:
            return [failure.reason()]
        if name not in self.backends:
            return [f"backend {name!r} is not installed (installed: {self.backend_names()})"]
        return self.backends[name].not_supported_reasons(request, config, self, self.env)

    def backend_priority(self) -> list[str]:
        specs = sorted(self.backends.values(), key=lambda s: (-s.priority, s.name))
        failed = sorted(n for g, n in self.failures if g == BACKEND_GROUP)
        return [s.name for s in specs] + failed

    def select_backend(
        self, name: str, request: SupportRequest, config: FlashLoopConfig
    ) -> BackendSelection:
        """Resolve ``name`` (or ``auto``). Raises :class:`UnservableError` (a ``ValueError``)
        listing every reason, or ``ConfigError`` for a ``kernel_overrides`` op that does
        not exist."""
        check_override_ops(config)
        if name != AUTO:
            if name not in self.backend_names():
                raise UnservableError(
                    f"unknown backend {name!r}; valid names: {[AUTO, *self.backend_names()]}"
                )
            reasons = self.backend_reasons(name, request, config)
            if reasons:
                raise UnservableError(
                    f"backend {name!r} cannot serve this request:\n  - " + "\n  - ".join(reasons)
                )
            info = SelectionInfo(name, name, "explicitly requested")
            return BackendSelection(self.backends[name], info)
        rejected: dict[str, list[str]] = {}
        for candidate in self.backend_priority():
            reasons = self.backend_reasons(candidate, request, config)
            if not reasons:
                why = f"auto: first usable backend in priority order {self.backend_priority()}"
                info = SelectionInfo(AUTO, candidate, why)
                LOG.info("auto selected backend %r (skipped: %s)", candidate, rejected or "none")
                return BackendSelection(self.backends[candidate], info, rejected)
            rejected[candidate] = reasons
        lines = [f"{n}: {'; '.join(r)}" for n, r in rejected.items()] or ["no backend is installed"]
        raise UnservableError("auto found no usable backend:\n  - " + "\n  - ".join(lines))

    def create(
        self,
        name: str,
        request: SupportRequest | None = None,
        config: FlashLoopConfig | None = None,
    ) -> BuiltBackend:
        """Select and build a backend object in one call."""
        request = request or SupportRequest.default(self.env)
        config = config or FlashLoopConfig()
        selection = self.select_backend(name, request, config)
        return selection.spec.create(request, config, self, selection.info)


def select_backend(
    name: str = AUTO,
    request: SupportRequest | None = None,
    config: FlashLoopConfig | None = None,
) -> BackendSelection:
    """The backend ``name`` (or ``auto``'s choice) for ``request`` and ``config``, with
    why every other candidate was skipped (installed plugins, read once per process)."""
    registry = Registry.discover()
    request = request or SupportRequest.default(registry.env)
    return registry.select_backend(name, request, config or FlashLoopConfig())


def create_backend(
    name: str = AUTO,
    request: SupportRequest | None = None,
    config: FlashLoopConfig | None = None,
) -> BuiltBackend:
    """Select and build the backend ``name`` (or ``auto``'s choice) in one call."""
    return Registry.discover().create(name, request, config)


def check_override_ops(config: FlashLoopConfig) -> None:
    """Every ``kernel_overrides`` key must name an op (``ConfigError`` listing them)."""
    allowed = [op.value for op in OpName]
    unknown = [op for op in config.kernel_overrides if op not in allowed]
    if unknown:
        raise ConfigError(f"kernel_overrides has unknown op {unknown[0]!r}; allowed ops: {allowed}")


def resolve(
    config: FlashLoopConfig | None = None,
    backend: str = "flashloop",
    request: SupportRequest | None = None,
    registry: Registry | None = None,
) -> EffectiveConfig:
    """The one immutable effective config: backend and kernel per op resolved and checked."""
    config = config or FlashLoopConfig()
    registry = registry or Registry.discover()
    request = request or SupportRequest.default(registry.env)
    for op, impl_name in config.kernel_overrides.items():
        if impl_name not in registry.kernel_names():
            raise UnservableError(
                f"kernel_overrides.{op}: implementation {impl_name!r} is not installed; "
                f"installed: {registry.kernel_names()}"
            )
    selection = registry.select_backend(backend, request, config)
    kernels = selection.spec.kernel_choices(request, config, registry)
    encoding = selection.spec.kv_encoding(config)
    return EffectiveConfig(
        config=config,
        backend=selection.info.selected_backend,
        kernels=kernels,
        package_version=__version__,
        kv_encoding=encoding,
    )


def capability_table(registry: Registry, config: FlashLoopConfig) -> dict[str, dict[str, bool]]:
    """backend name -> {capability: delivered on this machine's best device}."""
    device = registry.env.devices()[-1]
    table = {}
    for name, spec in registry.backends.items():
        caps = spec.capabilities(registry, config, registry.env, device)
        table[name] = {c.value: c in caps for c in Capability}
    return table


# ------------------------------------------------------------------- helpers
def _load_group(
    group: str, refresh: bool
) -> tuple[dict[str, tuple[str, object]], list[LoadFailure]]:
    if refresh:
        ExtensionManager.ENTRY_POINT_CACHE.pop(group, None)
    failures: list[LoadFailure] = []

    def on_failure(_manager: object, entry_point: object, error: Exception) -> None:
        failures.append(
            LoadFailure(
                group,
                entry_point.name,  # type: ignore[attr-defined]
                entry_point.value,  # type: ignore[attr-defined]
                f"{type(error).__name__}: {error}",
            )
        )

    manager = ExtensionManager(group, on_load_failure_callback=on_failure)
    targets: dict[str, set[str]] = defaultdict(set)
    loaded: dict[str, tuple[str, object]] = {}
    for ext in manager.extensions:
        targets[ext.name].add(ext.entry_point.value)
        loaded[ext.name] = (ext.entry_point.value, ext.plugin)
    for failure in failures:
        targets[failure.name].add(failure.target)
    # The same target seen twice (one distribution on two path entries) is one plugin;
    # two different targets under one name are a conflict nobody can resolve silently.
    for name, values in targets.items():
        if len(values) > 1:
            loaded.pop(name, None)
            failures = [f for f in failures if f.name != name]
            failures.append(
                LoadFailure(
                    group,
                    name,
                    " | ".join(sorted(values)),
                    f"name {name!r} is registered by more than one plugin ({sorted(values)}); "
                    "uninstall all but one",
                )
            )
    for failure in failures:
        if failure.name in loaded:
            loaded.pop(failure.name)
    return loaded, failures


def _call_factory(
    group: str,
    name: str,
    target: str,
    factory: object,
    expected: type,
    failures: list[LoadFailure],
) -> object | None:
    try:
        obj = factory() if callable(factory) else factory  # type: ignore[operator]
    except Exception as exc:  # a broken plugin becomes a reason, never a crash
        failures.append(LoadFailure(group, name, target, f"{type(exc).__name__}: {exc}"))
        return None
    if not isinstance(obj, expected):
        failures.append(
            LoadFailure(
                group, name, target, f"returned {type(obj).__name__}, expected {expected.__name__}"
            )
        )
        return None
    if getattr(obj, "name", name) != name:
        failures.append(
            LoadFailure(
                group, name, target, f"entry point {name!r} returned an object named {obj.name!r}"
            )  # type: ignore[attr-defined]
        )
        return None
    return obj
