"""Runs ../shared/bench/openai_load.py with a new connection per request: ``openai_load_fresh.py
DIR ARGS...`` runs DIR/openai_load.py with ARGS.

llama.cpp's server (the version llama-cpp-python 0.3.36 vendors) drops a kept-alive connection
after a streamed response, and aiohttp 3.14 then fails the next request on it with "Can not write
request body"; closing each connection after its response avoids that. Same prompts and metrics.
"""

import os
import runpy
import sys

import aiohttp

_Session = aiohttp.ClientSession


def _fresh_connections(*args, **kwargs) -> aiohttp.ClientSession:
    kwargs.setdefault("connector", aiohttp.TCPConnector(force_close=True))
    return _Session(*args, **kwargs)


aiohttp.ClientSession = _fresh_connections
script = os.path.join(sys.argv.pop(1), "openai_load.py")
sys.argv[0] = script
runpy.run_path(script, run_name="__main__")
