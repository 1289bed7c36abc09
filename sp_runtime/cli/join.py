"""`python -m sp_runtime join HOST:PORT --token-file F --name NAME --devices D --models DIR`: run on another
machine, it starts that machine's workers for the host's pool and serves them; after the pool stops or restarts
(or the network drops) it joins again, until stopped with Ctrl+C. docs/MULTI_MACHINE.md.
"""
from __future__ import annotations

import argparse
import logging
import socket
import sys
import time

RETRY_S = 1.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("address", help="the host's join address HOST:PORT (its pool's listen address)")
    parser.add_argument("--token-file", required=True, help="the shared secret, the same file as on the host "
                                                            "(chmod 600)")
    parser.add_argument("--name", default=socket.gethostname().split(".")[0].lower(),
                        help="this machine's name in the host's devices (e.g. node2 for 'node2:0-3'); default: "
                             "the host name")
    parser.add_argument("--devices", default="auto", help="devices this machine offers: 'auto', '0-3', 'cpu:2'")
    parser.add_argument("--models", default="", help="this machine's models folder: each model / LoRA the host "
                                                     "loads is the file of the same name here (checked)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads per CPU worker")
    parser.add_argument("--once", action="store_true", help="serve one session, do not join again")


def run(args: argparse.Namespace) -> int:
    from ..devices import parse_devices
    from ..pool.joined import Refused, Session, connect
    from ..pool.remote import parse_address
    from ..pool.wire import read_token
    logging.basicConfig(level=logging.INFO, format="%(asctime)s join: %(message)s")
    try:
        token = read_token(args.token_file)
        devices = parse_devices(args.devices)
        host, port = parse_address(args.address)
    except ValueError as error:
        print(f"join: {error}", file=sys.stderr)
        return 2
    waiting = False
    while True:
        try:
            sock = connect(host, port, token, args.name, devices)
        except Refused as refused:
            print(f"join: the host refused machine {args.name!r}: {refused}", file=sys.stderr)
            return 2
        except OSError as error:
            if not waiting:
                print(f"join: waiting for the host at {host}:{port} ({error})", file=sys.stderr)
                waiting = True
            time.sleep(RETRY_S)
            continue
        waiting = False
        print(f"join: machine {args.name!r} joined {host}:{port} offering {devices}", file=sys.stderr)
        try:
            Session(sock, args.name, args.models, args.threads).serve()
        except (ConnectionError, OSError) as error:
            print(f"join: the session ended: {error}", file=sys.stderr)
        if args.once:
            return 0
