import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_committed_stubs_match_the_protos():
    r = subprocess.run(
        [sys.executable, str(ROOT / "proto" / "generate.py"), "--check"],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr


def test_stubs_import_and_round_trip():
    from pdserve.v1 import common_pb2, generation_pb2

    req = generation_pb2.GenerateRequest(
        text="hi", sampling=common_pb2.SamplingParams(max_tokens=4, temperature=0)
    )
    again = generation_pb2.GenerateRequest.FromString(req.SerializeToString())
    assert again.WhichOneof("prompt") == "text" and again.sampling.HasField("temperature")
