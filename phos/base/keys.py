"""Key files of phos's CURVE authentication, as `phos keygen` lays them out: read by the server,
the pool and the command line alike."""
import os


def load_curve(auth_dir):
    """(public, secret, authorized-clients dir, admins dir or None) from a directory made by
    `phos keygen`: clients/ holds the keys that may make contexts, admins/ those that may call
    the admin API over TCP (without it, the admin API stays on the Unix socket)."""
    import zmq.auth        # not at import: the command line loads no ZeroMQ it does not use
    public, secret = zmq.auth.load_certificate(os.path.join(auth_dir, "server.key_secret"))
    clients = os.path.join(auth_dir, "clients")
    if not os.path.isdir(clients):
        raise SystemExit(f"phos: {clients} is missing: put the public keys of authorized clients there")
    admins = os.path.join(auth_dir, "admins")
    return public, secret, clients, admins if os.path.isdir(admins) else None
