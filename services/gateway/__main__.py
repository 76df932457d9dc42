"""`python -m services.gateway [--config FILE]`."""

from services.gateway.app import create_app
from services.gateway.config import ENV_PREFIX, GatewayConfig
from services.runtime.main import run_service

if __name__ == "__main__":
    run_service("gateway", GatewayConfig, ENV_PREFIX, create_app)
