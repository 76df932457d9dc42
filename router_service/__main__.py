"""`python -m router_service [--config FILE]`."""

from router_service.app import create_app
from router_service.config import ENV_PREFIX, RouterConfig
from services.runtime.main import run_service

if __name__ == "__main__":
    run_service("router", RouterConfig, ENV_PREFIX, create_app)
