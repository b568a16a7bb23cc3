"""python -m services.parsing"""

from services.parsing.app import service
from shared.service import run

if __name__ == "__main__":
    run(service)
