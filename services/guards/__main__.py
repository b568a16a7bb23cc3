"""python -m services.guards"""

from services.guards.app import service
from shared.service import run

if __name__ == "__main__":
    run(service)
