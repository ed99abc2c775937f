"""The image's HEALTHCHECK: exit 0 when the proxy's /ready answers 200, else 1.

Reads the same TRACE_PROXY_HOST / TRACE_PROXY_ADMIN_PORT variables as the proxy, so a changed
admin port is followed; standard library only (the image has no curl, no shell).
"""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request
from collections.abc import Mapping

WILDCARDS = ("", "0.0.0.0", "::")


def ready_url(environ: Mapping[str, str]) -> str:
    host = environ.get("TRACE_PROXY_HOST", "127.0.0.1")
    host = "127.0.0.1" if host in WILDCARDS else host
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{environ.get('TRACE_PROXY_ADMIN_PORT', '8101')}/ready"


def main() -> int:
    url = ready_url(os.environ)
    try:
        with urllib.request.urlopen(url, timeout=4) as response:
            return 0 if response.status == 200 else 1
    except urllib.error.HTTPError as exc:  # 503: says what is not ready yet
        print(f"{url}: {exc.code} {exc.read().decode(errors='replace')}")
    except (urllib.error.URLError, OSError) as exc:
        print(f"{url}: {exc}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
