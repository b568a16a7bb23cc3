"""python -m services.generation"""

from services.generation.app import service
from shared.runtime.harness import run

if __name__ == "__main__":
    run(service)
