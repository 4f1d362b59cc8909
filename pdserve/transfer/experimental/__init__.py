"""KV transports that no service uses: kept, tested as far as a machine allows, not selectable
by ``create_transport`` or ``--transport``.

``nccl.py`` (with ``nccl_lib.py``, ctypes over libnccl): GPU to GPU over NCCL. Its handshake needs
an RPC from the prefill to the decode worker that the services do not have, and an NCCL transfer
between two processes needs two GPUs: it has never run end to end. UCX moves GPU memory too.
"""
