"""`python -m storage_service [--config FILE]`."""

from services.runtime.main import run_service
from storage_service.app import create_app
from storage_service.config import ENV_PREFIX, StorageConfig

if __name__ == "__main__":
    run_service("storage", StorageConfig, ENV_PREFIX, create_app)
