"""`ember browser`: serve a model and open Ember's chat page in a web browser.

    ember browser                      # the default model, page at http://127.0.0.1:8000/
    ember browser smollm2-135m-instruct --port 8080 --no-open

It is `ember serve` (same options, same server) plus a watcher thread that waits for /health, prints the
page's address, and opens it with `webbrowser` unless --no-open is given or there is no graphical browser
(a Linux machine without DISPLAY or WAYLAND_DISPLAY: there `webbrowser` would start a text browser such as
lynx in this terminal). The page is the app's own static files, so no other process is needed.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import time
import urllib.error
import urllib.request
import webbrowser

from ember.cli import serve

log = logging.getLogger(__name__)

POLL_S = 0.25


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "browser",
        help="serve a model and open the chat page in a web browser",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        parents=[_serve_options()],
        # The parent's -h/--help replaces this parser's own; both print this parser's help.
        conflict_handler="resolve",
    )
    p.add_argument("--no-open", action="store_true", help="only print the page's address; open no browser")
    p.set_defaults(run=run)


def _serve_options() -> argparse.ArgumentParser:
    """`ember serve`'s parser, so that both subcommands share every option and its default."""
    holder = argparse.ArgumentParser(add_help=False).add_subparsers()
    serve.add_parser(holder)
    return holder.choices["serve"]


def page_url(host: str, port: int) -> str:
    """The address a local browser reaches the page at (a wildcard bind is reached through loopback)."""
    if host in ("", "0.0.0.0"):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}/"


def can_open_browser() -> bool:
    """False where `webbrowser` could only start a text browser (no display on Linux, BROWSER unset)."""
    if os.environ.get("BROWSER"):
        return True
    if sys.platform.startswith("linux"):
        return bool(os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY"))
    return True


def announce_when_ready(url: str, *, open_browser: bool, api_key: bool) -> None:
    """Waits until the server answers /health, then prints `url` and opens it if asked and possible."""
    while True:
        try:
            with urllib.request.urlopen(url + "health", timeout=2) as resp:
                if resp.status == 200:
                    break
        except (urllib.error.URLError, OSError):
            pass  # not listening yet: the model is still loading
        time.sleep(POLL_S)
    print(f"Ember chat page: {url}", flush=True)
    if api_key:
        print("The server has an API key: enter it once under Settings on the page.", flush=True)
    if not open_browser:
        return
    if can_open_browser() and webbrowser.open(url):
        return
    print("No web browser to open here; open the address above in one.", flush=True)


def run(args: argparse.Namespace) -> int:
    url = page_url(args.host, args.port)
    watcher = threading.Thread(
        target=announce_when_ready,
        args=(url,),
        kwargs={"open_browser": not args.no_open, "api_key": args.api_key is not None},
        name="ember-browser-open",
        daemon=True,  # dies with the server, also when the model fails to load
    )
    watcher.start()
    return serve.run(args)
