"""`python -m phos.gpu_server.worker`: how the front end starts a context worker (main.py)."""
import sys

from phos.gpu_server.worker.main import main

sys.exit(main())
