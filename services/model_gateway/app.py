"""Assembles the model gateway: meter, chat provider, web tools, servicer, host."""

from __future__ import annotations

import logging
import math

from system.model.v1 import model_pb2, model_pb2_grpc

from services.model_gateway.alerts import AdminNotices
from services.model_gateway.budgets import dearest_micros_per_token
from services.model_gateway.config import ModelConfig
from services.model_gateway.leasing import LeaseMeter, LeasePolicy
from services.model_gateway.metering import Meter, NoMeter
from services.model_gateway.provider import ChatProvider
from services.model_gateway.servicer import ModelGatewayServicer
from services.model_gateway.usage_store import UsageStore
from services.model_gateway.web import SafeFetcher, SearchSessions, SearxngProvider, WebTools
from services.runtime.security import AccessPolicy
from services.runtime.server import ServiceHost

__all__ = ["ModelApp", "create_app"]

SERVICE_NAME = model_pb2.DESCRIPTOR.services_by_name["ModelGatewayService"].full_name

ACCESS = AccessPolicy({SERVICE_NAME: ["router", "engine"]})
"""Who may call the model gateway: the router (its one routing call) and the engine (runs).
Operators may call everything."""

log = logging.getLogger("system.model")


def make_meter(config: ModelConfig, notices: AdminNotices | None = None) -> Meter:
    if not config.storage_target:
        log.warning(
            "storage_target is empty: no metering, no daily budgets and no check of the players' "
            "external-services preference; never run players against this gateway"
        )
        return NoMeter()
    store = UsageStore(
        config.storage_target,
        config.budgets,
        config.storage_timeout_seconds,
        config.channel_settings(),
        notify=notices.alert if notices is not None else None,
    )
    return LeaseMeter(
        store,
        LeasePolicy(
            tokens=config.lease_tokens,
            web_searches=config.lease_web_searches,
            # What the lease's tokens may cost at the dearest model: money is held with them.
            cost_micros=math.ceil(config.lease_tokens * dearest_micros_per_token(config.routing)),
            refresh_seconds=config.lease_refresh_seconds,
            idle_seconds=config.lease_idle_seconds,
            ttl_seconds=config.lease_ttl_seconds,
        ),
    )


class ModelApp:
    """The running model gateway and what it owns."""

    def __init__(self, config: ModelConfig) -> None:
        self.notices = (
            AdminNotices(
                config.relay_target,
                config.alert_permission_level,
                config.channel_settings(),
                storage_target=config.storage_target,
            )
            if config.relay_target
            else None
        )
        self.meter = make_meter(config, self.notices)
        self.provider = ChatProvider(config, self.meter)
        self.web = WebTools(
            config,
            self.meter,
            SearxngProvider(config.search_url) if config.search_url else None,
            SafeFetcher(
                max_bytes=config.fetch_max_bytes,
                max_redirects=config.fetch_max_redirects,
                allow_loopback=config.fetch_allow_loopback,
            ),
            SearchSessions(config.search_session_ttl_seconds, config.max_search_sessions),
        )
        servicer = ModelGatewayServicer(self.provider, self.web)
        self.host = ServiceHost(
            "model-gateway",
            config,
            [
                lambda server: model_pb2_grpc.add_ModelGatewayServiceServicer_to_server(
                    servicer, server
                )
            ],
            [SERVICE_NAME],
            access=ACCESS,
        )
        if not config.configured:
            log.warning(
                "no API key (SYSTEM_MODEL_API_KEY or SYSTEM_MODEL_API_KEY_FILE); Complete answers "
                "UNAVAILABLE and callers fall back to local routing"
            )
        if config.fetch_allow_loopback:
            log.warning("fetch_allow_loopback is on: WebFetch may reach loopback addresses")

    async def aclose(self) -> None:
        await self.provider.aclose()
        await self.web.aclose()
        await self.meter.aclose()
        if self.notices is not None:
            await self.notices.aclose()


async def create_app(config: ModelConfig) -> ModelApp:
    return ModelApp(config)
