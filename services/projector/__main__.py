"""`python -m services.projector`: run the projector with settings from VERIBUS_* env vars."""

from services.projector.app import main

if __name__ == "__main__":
    main()
