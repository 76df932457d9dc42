"""Keeps the engine's module catalogue, re-read periodically, with what derives from it: the
command index and the semantic router (rebuilt off the event loop when the generation changes).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import time
from pathlib import Path

from system.common.v1 import catalog_pb2
from system.engine.v1 import engine_pb2, engine_pb2_grpc

from router_service.commands import CommandIndex
from router_service.semantic import Profile, SemanticConfig, SemanticRouter, load_profiles
from services.runtime.errors import Unavailable

__all__ = [
    "Catalog",
    "CatalogCache",
    "descriptors_from_profiles",
    "profiles_from_catalog",
    "standalone_catalog",
]

log = logging.getLogger("system.router.catalog")


def profiles_from_catalog(
    modules: list[catalog_pb2.ModuleDescriptor], rejects: list[catalog_pb2.RejectProfile]
) -> list[Profile]:
    """The semantic profiles the registry declares: READ modules may route directly, HINTS and
    EXPLICIT_ONLY only add candidates, STRUCTURED_ONLY ones take no part; reject profiles
    widen margins and never execute."""
    profiles = []
    for module in modules:
        mode = module.routing_mode
        if not module.HasField("semantic") or mode in (
            catalog_pb2.ROUTING_MODE_UNSPECIFIED,
            catalog_pb2.ROUTING_MODE_STRUCTURED_ONLY,
        ):
            continue
        semantic = module.semantic
        profiles.append(
            Profile(
                module_id=module.module_id,
                kind="read" if mode == catalog_pb2.ROUTING_MODE_READ else "hints",
                examples={e.language: tuple(e.examples) for e in semantic.examples},
                interactive=module.interactive,
                write_steps=module.write_steps,
                read_only_tools=semantic.read_only_tools,
                explicit_only=mode == catalog_pb2.ROUTING_MODE_EXPLICIT_ONLY,
                extractor=semantic.extractor or None,
                choice_label=semantic.choice_label,
                shortcut=semantic.shortcut,
            )
        )
    for reject in rejects:
        profiles.append(
            Profile(
                module_id=reject.profile_id,
                kind="reject",
                examples={e.language: tuple(e.examples) for e in reject.examples},
            )
        )
    return profiles


@dataclasses.dataclass(frozen=True)
class Catalog:
    """One generation of the catalogue and what derives from it."""

    generation: str
    modules: dict[str, catalog_pb2.ModuleDescriptor]
    commands: CommandIndex
    semantic: SemanticRouter


def descriptors_from_profiles(profiles: list[Profile]) -> list[catalog_pb2.ModuleDescriptor]:
    """Module descriptors for a standalone profile set (no engine): what the router needs to
    know of each module to apply its gates, and nothing it could execute."""
    descriptors = []
    for profile in profiles:
        if profile.kind == "reject":
            continue
        mode = (
            catalog_pb2.ROUTING_MODE_READ
            if profile.kind == "read"
            else catalog_pb2.ROUTING_MODE_HINTS
        )
        if profile.kind == "read" and not profile.direct:
            mode = catalog_pb2.ROUTING_MODE_HINTS
        if profile.explicit_only:
            mode = catalog_pb2.ROUTING_MODE_EXPLICIT_ONLY
        if profile.structured_only:
            mode = catalog_pb2.ROUTING_MODE_STRUCTURED_ONLY
        descriptors.append(
            catalog_pb2.ModuleDescriptor(
                module_id=profile.module_id,
                input_schema='{"type": "object"}',
                routing_mode=mode,
                interactive=profile.interactive,
                write_steps=profile.write_steps,
                semantic=catalog_pb2.SemanticProfile(
                    examples=[
                        catalog_pb2.LanguageExamples(language=lang, examples=list(texts))
                        for lang, texts in profile.examples.items()
                    ],
                    extractor=profile.extractor or "",
                    choice_label=profile.choice_label,
                    read_only_tools=profile.read_only_tools,
                    shortcut=bool(profile.is_shortcut),
                ),
            )
        )
    return descriptors


def standalone_catalog(path: str, config: SemanticConfig) -> Catalog:
    """A catalogue from a profile-set file, for running the router without the engine."""
    _language, profiles = load_profiles(path)
    modules = descriptors_from_profiles(profiles)
    generation = "file-" + hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]
    return Catalog(
        generation=generation,
        modules={m.module_id: m for m in modules},
        commands=CommandIndex(modules, generation),
        semantic=SemanticRouter(profiles, config),
    )


class CatalogCache:
    """The latest catalogue. Read on first use, then refreshed when older than
    `refresh_seconds`; if a refresh fails the previous catalogue keeps serving."""

    def __init__(
        self,
        engine: engine_pb2_grpc.EngineServiceAsyncStub | None,
        refresh_seconds: float,
        semantic_config: SemanticConfig,
        static: Catalog | None = None,
    ) -> None:
        """With `static` (a standalone profile set) the engine is never asked."""
        self._engine = engine
        self._refresh_seconds = refresh_seconds
        self.semantic_config = semantic_config
        self._catalog: Catalog | None = static
        self._static = static is not None
        self._fetched_at = 0.0
        self._lock = asyncio.Lock()

    @property
    def current(self) -> Catalog | None:
        return self._catalog

    async def get(self) -> Catalog:
        """The current catalogue. Raises Unavailable when none was ever read."""
        if self._catalog is not None and (
            self._static or time.monotonic() - self._fetched_at < self._refresh_seconds
        ):
            return self._catalog
        async with self._lock:
            if (
                self._catalog is None
                or time.monotonic() - self._fetched_at >= self._refresh_seconds
            ):
                await self._refresh()
        assert self._catalog is not None
        return self._catalog

    async def _refresh(self) -> None:
        assert self._engine is not None
        try:
            response = await self._engine.GetCatalog(engine_pb2.GetCatalogRequest(), timeout=5.0)
        except Exception as exc:  # noqa: BLE001 - any failure: keep serving the old catalogue
            if self._catalog is None:
                raise Unavailable(
                    f"the module catalogue could not be read from the engine: {exc}"
                ) from None
            log.warning("catalogue refresh failed, keeping %s: %s", self._catalog.generation, exc)
            self._fetched_at = time.monotonic()
            return
        if self._catalog is None or self._catalog.generation != response.generation:
            modules = list(response.modules)
            profiles = profiles_from_catalog(modules, list(response.reject_profiles))
            # Building the index takes a while (jieba, vectorisers): keep the loop free.
            semantic = await asyncio.to_thread(SemanticRouter, profiles, self.semantic_config)
            self._catalog = Catalog(
                generation=response.generation,
                modules={m.module_id: m for m in modules},
                commands=CommandIndex(modules, response.generation),
                semantic=semantic,
            )
            log.info(
                "catalogue generation %s: %d modules, %d examples indexed",
                response.generation,
                len(modules),
                semantic.example_count,
            )
        self._fetched_at = time.monotonic()
