"""A pytest plugin that makes this process look like another machine: another kernel release
and version, host name and Python build, and other versions of the packages that report theirs
(aiohttp's User-Agent, Weave's client, the OpenTelemetry SDK). Loaded with `-p` before anything
else imports them, so the golden test can show that nothing it compares comes from the machine.
"""

from __future__ import annotations

import os
import platform
import socket
import sys

KERNEL_RELEASE = "0.0.1-another-kernel"
KERNEL_VERSION = "#7 SMP another build"
HOST_NAME = "another-host"
PYTHON_BUILD = "3.99.0 (another build) [another compiler]"
PACKAGE_VERSION = "99.0.1"


def _another_uname() -> os.uname_result:
    real = _real_uname()
    return os.uname_result((real.sysname, HOST_NAME, KERNEL_RELEASE, KERNEL_VERSION, real.machine))


_real_uname = os.uname
os.uname = _another_uname
platform._uname_cache = None  # type: ignore[attr-defined]  # computed anew from os.uname
socket.gethostname = lambda: HOST_NAME
sys.version = PYTHON_BUILD


def _other_package_versions() -> None:
    import aiohttp.client_reqrep
    import opentelemetry.sdk.resources as resources
    import weave.utils.capture_info

    aiohttp.client_reqrep.SERVER_SOFTWARE = f"Python/3.99 aiohttp/{PACKAGE_VERSION}"  # type: ignore[attr-defined]
    weave.utils.capture_info.VERSION = PACKAGE_VERSION
    resources._DEFAULT_RESOURCE = resources.Resource(
        {**resources._DEFAULT_RESOURCE.attributes, "telemetry.sdk.version": PACKAGE_VERSION}
    )


_other_package_versions()
