"""``adpkv-gateway``: run the storage gateway."""

from __future__ import annotations

import argparse
import logging
import sys

from adpkv_core import __version__

from adpkv_gateway import config as cfg
from adpkv_gateway.cards import CardError


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="adpkv-gateway", description="The adpkv storage gateway: serves one "
                                     "engine's KV pages from storage cards (see docs/gateway.md).")
    cfg.add_arguments(parser)
    parser.add_argument("--version", action="version", version=f"adpkv-gateway {__version__}")
    args = parser.parse_args(argv)
    try:
        config = cfg.from_args(args)
    except cfg.ConfigError as exc:
        print(f"adpkv-gateway: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=getattr(logging, config.log_level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Many I/O threads hand the GIL back and forth around short system calls; a short
    # switch interval keeps one thread's Python work from stalling the others' I/O.
    sys.setswitchinterval(0.0005)
    from adpkv_gateway.loop.server import Gateway
    try:
        gateway = Gateway(config)
    except CardError as exc:
        logging.getLogger("adpkv.gateway").error("%s", exc)
        return 2
    except SystemExit as exc:
        logging.getLogger("adpkv.gateway").error("%s", exc)
        return 2
    except OSError as exc:
        logging.getLogger("adpkv.gateway").error("cannot start: %s", exc)
        return 2
    gateway.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
