"""python -m services.verification"""

from services.verification.app import service
from shared.runtime.harness import run

if __name__ == "__main__":
    run(service)
