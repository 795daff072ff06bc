"""`anytime serve`: the service on a ladder. Every option is a setting (service/config.py): its default is there.

The API key is a setting only (ANYTIME_API_KEY): a command-line argument would show in `ps`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from cli.args import UsageError, positive
from service.config import Settings


def _default(name: str) -> object:
    return Settings.model_fields[name].default


def add_serve(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ladder", type=Path, help=f"ladder directory (default: {_default('ladder')})")
    p.add_argument("--host", help=f"bind address (default: {_default('host')})")
    p.add_argument("--port", type=int, help=f"port (default: {_default('port')})")
    p.add_argument("--threads", type=positive, help="threads per engine (default: the ladder's)")
    p.add_argument("--access-log", action="store_true", help="log one line per request (default: off)")
    p.add_argument("--log-format", choices=["text", "json"], help="log lines as text or JSON (default: text)")
    p.set_defaults(func=run_serve)


def run_serve(args: argparse.Namespace) -> None:
    import logging.config

    from pydantic import ValidationError

    from service.app import create_app
    from service.logs import log_config
    from service.server import serve

    given = {
        "ladder": args.ladder,
        "host": args.host,
        "port": args.port,
        "threads": args.threads,
        "log_format": args.log_format,
    }
    overrides = {k: v for k, v in given.items() if v is not None}
    if args.access_log:
        overrides["access_log"] = True
    try:
        settings = Settings(**overrides)
    except ValidationError as e:
        first = e.errors()[0]
        raise UsageError(f"bad setting {'.'.join(map(str, first['loc']))}: {first['msg']}") from None
    logging.config.dictConfig(log_config(settings.log_format))
    serve(create_app(settings), settings)
