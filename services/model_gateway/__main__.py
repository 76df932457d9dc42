"""`python -m services.model_gateway [--config FILE]`."""

from services.model_gateway.app import create_app
from services.model_gateway.config import ENV_PREFIX, ModelConfig
from services.runtime.main import run_service

if __name__ == "__main__":
    run_service("model-gateway", ModelConfig, ENV_PREFIX, create_app)
