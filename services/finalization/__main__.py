"""python -m services.finalization"""

from services.finalization.app import service
from shared.service import run

if __name__ == "__main__":
    run(service)
