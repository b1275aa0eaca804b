"""`python -m phos.gpu_server.worker`: how the front end starts a context worker (loop.py)."""
import sys

from phos.gpu_server.worker.loop import main

sys.exit(main())
