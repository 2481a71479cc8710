"""Network guard for the offline tests: put this directory on PYTHONPATH and set
DFCACHE_NETGUARD_LOG=PATH. Every socket the interpreter creates, every connect, every name
lookup is appended to PATH as a JSON line (with the Python stack that asked for it), and
connects and lookups fail, so a run that would touch the network cannot succeed by accident.
Without DFCACHE_NETGUARD_LOG this module does nothing.
"""

import os

_LOG = os.environ.get("DFCACHE_NETGUARD_LOG")

if _LOG:
    import errno
    import json
    import socket
    import traceback

    def _record(what, detail):
        entry = {"what": what, "detail": repr(detail), "pid": os.getpid(),
                 "stack": [line.strip() for line in traceback.format_stack(limit=60)[:-2]]}
        with open(_LOG, "a") as f:
            f.write(json.dumps(entry) + "\n")

    _init = socket.socket.__init__

    def __init__(self, family=-1, type=-1, proto=-1, fileno=None):
        _init(self, family, type, proto, fileno)
        _record("socket", {"family": str(self.family), "type": str(self.type), "from_fd": fileno is not None})

    def _refuse(name):
        def method(self, address, *a, **kw):
            _record(name, address)
            raise OSError(errno.EACCES, f"network access refused by the test's guard ({name} {address!r})")
        return method

    socket.socket.__init__ = __init__
    socket.socket.connect = _refuse("connect")
    socket.socket.connect_ex = _refuse("connect_ex")
    socket.socket.sendto = _refuse("sendto")

    def _refuse_fn(name):
        def fn(*a, **kw):
            _record(name, a[:2])
            raise socket.gaierror(socket.EAI_NONAME, f"name lookup refused by the test's guard ({name})")
        return fn

    for _name in ("getaddrinfo", "gethostbyname", "gethostbyname_ex", "gethostbyaddr", "create_connection"):
        setattr(socket, _name, _refuse_fn(_name))
    _record("guard", "installed")
