"""python -m services.finalization"""

from services.finalization.app import service
from shared.runtime.harness import run

if __name__ == "__main__":
    run(service)
