"""A pool of phos servers across machines, on Ray (`phos pool`).

controller.py   the named, detached pool controller (Ray actor): servers, placement, drains
server_actor.py one phos server per GPU (or per EMU_RESOURCE unit), as a Ray actor
frontend.py     the pool's address: places new contexts and routes re-attaches
placement.py    the placement policies
admin_client.py the one way the pool reaches a server's admin API
metrics.py      Prometheus metrics of the servers and the controller
cli.py          `phos pool up|status|drain|down`
"""
NAMESPACE = "phos"                 # the Ray namespace of the pool's named actors
CONTROLLER_NAME = "phos-pool"      # the controller's actor name
EMU_RESOURCE = "phos_emu"          # the custom resource a node without GPUs offers per emu server
CUDA_SHARED_RESOURCE = "phos_cuda"  # ... a node offers per cuda server sharing its GPUs (several on one GPU)
