"""python -m services.parsing"""

from services.parsing.app import service
from shared.runtime.harness import run

if __name__ == "__main__":
    run(service)
