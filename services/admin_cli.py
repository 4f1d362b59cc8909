"""The operator's file commands: ``pdserve keys add|remove`` (the gateway's API key file) and
``pdserve certs`` (a cluster CA and certificates)."""

from __future__ import annotations

import sys


def admin_commands(sub) -> None:
    _keys_commands(sub)
    c = sub.add_parser(
        "certs",
        help="make a cluster CA (ca.pem; its key is not kept) and gateway and worker "
        "certificates issued by it, for --tls-ca/--tls-cert/--tls-key",
    )
    c.add_argument("folder", help="written into (key files 0600)")
    c.add_argument(
        "--host",
        action="append",
        default=[],
        help="a DNS name or IP address the certificates are for (repeatable); loopback is added",
    )
    c.set_defaults(func=cmd_certs)


def cmd_certs(args) -> int:
    """Write a new cluster CA and a gateway and a worker certificate into ``args.folder``."""
    from pathlib import Path

    from pdserve.certs import LOCAL_NAMES, make_cluster_certs

    made = make_cluster_certs(Path(args.folder), (*args.host, *LOCAL_NAMES))
    for name, f in made.items():
        print(f"{name}: --tls-ca {f.ca} --tls-cert {f.cert} --tls-key {f.key}")
    return 0


def cmd_keys(args) -> int:
    """``pdserve keys add|remove``: edit a key file; ``add`` prints the new key, once."""
    from pathlib import Path

    from pdserve.services.gateway.auth import KeyLimits, add_key, remove_key

    path = Path(args.file)
    try:
        if args.keys_command == "add":
            limits = KeyLimits(rpm=args.rpm, tpm=args.tpm, concurrency=args.concurrency)
            print(add_key(path, args.id, limits))
            print(
                f"added key {args.id!r} to {path}; the key above is not stored anywhere, keep it "
                "(a running gateway reads the file again on SIGHUP)",
                file=sys.stderr,
            )
        else:
            remove_key(path, args.id)
            print(f"removed key {args.id!r} from {path}", file=sys.stderr)
    except ValueError as e:
        print(f"pdserve keys: {e}", file=sys.stderr)
        return 2
    return 0


def _keys_commands(sub) -> None:
    k = sub.add_parser("keys", help="manage the gateway's API key file")
    ksub = k.add_subparsers(dest="keys_command", required=True)
    add = ksub.add_parser("add", help="add a key and print it (once); the file keeps its hash")
    rm = ksub.add_parser("remove", help="remove a key by id")
    for p in (add, rm):
        p.add_argument("--file", required=True, help="the key file (created by add if missing)")
        p.add_argument("--id", required=True, help="the key's name in logs and metrics")
    add.add_argument(
        "--rpm", type=int, default=None, help="requests per minute (default: no limit)"
    )
    add.add_argument(
        "--tpm",
        type=int,
        default=None,
        help="tokens per minute, prompt + max_tokens reserved at admission (default: no limit)",
    )
    add.add_argument(
        "--concurrency", type=int, default=None, help="requests at once (default: no limit)"
    )
    k.set_defaults(func=cmd_keys)
