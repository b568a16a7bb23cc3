"""python -m services.rubric"""

from services.rubric.app import service
from shared.runtime.harness import run

if __name__ == "__main__":
    run(service)
