"""python -m services.guards"""

from services.guards.app import service
from shared.runtime.harness import run

if __name__ == "__main__":
    run(service)
