"""`python -m engine_service [--config FILE]`."""

from engine_service.app import create_app
from engine_service.config import ENV_PREFIX, EngineConfig
from services.runtime.main import run_service

if __name__ == "__main__":
    run_service("engine", EngineConfig, ENV_PREFIX, create_app)
