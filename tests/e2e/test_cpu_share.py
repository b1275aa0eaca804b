"""Each tenant's context workers weigh one worker together on the host's CPU
(gpu_server/control/cpu_share.py): a tenant does not take more of it by opening more contexts."""
import os
import subprocess
import sys

import pytest

from conftest import wait_until
from share_nothing import free_port_pair
from wire_client import RawSession
from phos.admin_cli import stub as admin
from phos.gpu_server.control.cpu_share import nice_for
from phos.schema import admin_pb2 as pb

NOBODY_HOLDS_A_CONTEXT = """
import os, sys
sys.path.insert(0, sys.argv[2])
from wire_client import RawSession
os.setgid(65534); os.setuid(65534)
s = RawSession(sys.argv[1])
print(s.ctx, flush=True)
sys.stdin.readline()
"""


def nice_levels(pid):
    """The nice level of every thread of process pid."""
    return {os.getpriority(os.PRIO_PROCESS, int(tid)) for tid in os.listdir(f"/proc/{pid}/task")}


def test_a_tenants_workers_share_one_workers_weight(servers):
    if os.geteuid() != 0:
        pytest.skip("needs root, for a second local user (and to give a share back)")
    srv = servers("share", listen=f"tcp://127.0.0.1:{free_port_pair()}", args=("--insecure",))
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    other = subprocess.Popen([sys.executable, "-c", NOBODY_HOLDS_A_CONTEXT, srv.address, tests], text=True,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd="/")
    mine = []
    try:
        theirs = int(other.stdout.readline())
        mine = [RawSession(srv.address) for _ in range(4)]

        def pids():
            return {c.id: c.pid for c in admin(srv.address).ListContexts(pb.ListContextsRequest(), timeout=30).contexts}
        base = os.getpriority(os.PRIO_PROCESS, srv.proc.pid)     # the server's own level (the tests run niced)
        assert nice_for(4) == 6 and nice_for(1) == 0
        assert wait_until(lambda: all(nice_levels(pids()[s.ctx]) == {min(19, base + 6)} for s in mine), 10), \
            {s.ctx: nice_levels(pids()[s.ctx]) for s in mine}
        assert nice_levels(pids()[theirs]) == {base}        # another tenant's one worker keeps its whole weight
        for s in mine[1:]:
            s.close()
        mine = mine[:1]
        assert wait_until(lambda: nice_levels(pids()[mine[0].ctx]) == {base}, 10)   # alone again: a whole weight
    finally:
        for s in mine:
            s.close()
        other.stdin.write("\n")
        other.stdin.close()
        other.wait(30)
