"""Hosts made of network namespaces, for tests that run ranks and replicas "on other machines".

```
 host 0 (netns)        host 1 (netns)        ...        every address lives inside the namespaces:
  eth0 10.213.0.1       eth0 10.213.0.2                 the machine's own namespace gets no link, route
     │                     │                            or address, and all is deleted afterwards
     └── b0 ── br0 ── b1 ──┘   (a bridge in a switch namespace of its own)
```

Each host has its own loopback, ports and addresses, so ranks and replicas reach each other only over the
bridge, as over a network. Creating namespaces needs root (CAP_SYS_ADMIN and CAP_NET_ADMIN); where that fails,
`NamespaceHosts.skip_unless_possible()` skips the test and says why.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SUBNET = "10.213.0"  # a private range, used inside the namespaces only
REPO_ROOT = Path(__file__).parents[1]


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


class NamespaceHosts:
    """`num_hosts` namespaces joined by a bridge; host i has address `address(i)` on its eth0."""

    def __init__(self, num_hosts: int) -> None:
        tag = f"kvf{os.getpid() % 100000}"
        self.switch = f"{tag}sw"
        self.names = [f"{tag}h{i}" for i in range(num_hosts)]
        self._created: list[str] = []

    @staticmethod
    def skip_unless_possible() -> None:
        """Skip the calling test where namespaces cannot be made here (no `ip`, not root)."""
        if shutil.which("ip") is None:
            pytest.skip("network-namespace hosts need the `ip` command (iproute2)")
        probe = f"kvfprobe{os.getpid() % 100000}"
        made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
        if made.returncode != 0:
            pytest.skip(f"cannot create network namespaces here (root is needed): {made.stderr.strip()}")
        _ip("netns", "del", probe)

    @staticmethod
    def address(host: int) -> str:
        return f"{SUBNET}.{host + 1}"

    def __enter__(self) -> NamespaceHosts:
        try:
            self._add(self.switch)
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br0", "up")
            for i, name in enumerate(self.names):
                self._add(name)
                _ip("-n", self.switch, "link", "add", f"b{i}", "type", "veth", "peer", "name", "eth0", "netns", name)
                _ip("-n", self.switch, "link", "set", f"b{i}", "master", "br0", "up")
                _ip("-n", name, "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
                _ip("-n", name, "link", "set", "eth0", "up")
        except BaseException:
            self.__exit__()
            raise
        return self

    def _add(self, name: str) -> None:
        _ip("netns", "add", name)
        self._created.append(name)
        _ip("-n", name, "link", "set", "lo", "up")

    def __exit__(self, *_: object) -> None:
        for name in reversed(self._created):  # deleting a namespace deletes its veth ends and the bridge
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        self._created.clear()

    def command(self, host: int, argv: list[str]) -> list[str]:
        """argv run on host `host`."""
        return ["ip", "netns", "exec", self.names[host], *argv]

    def popen(self, host: int, argv: list[str], env: dict[str, str] | None = None, **kwargs) -> subprocess.Popen:
        """Start argv on host `host`, with the repository importable and GLOO on the host's eth0."""
        return subprocess.Popen(self.command(host, argv), env=self.env(env), **kwargs)

    def run_python(self, host: int, code: str, *args: str, env: dict[str, str] | None = None,
                   timeout: float = 300) -> subprocess.CompletedProcess:
        """Run a Python snippet on host `host` (e.g. a client of a server there); its output comes back."""
        return subprocess.run(self.command(host, [sys.executable, "-c", code, *args]), env=self.env(env),
                              capture_output=True, text=True, timeout=timeout)

    @staticmethod
    def env(extra: dict[str, str] | None) -> dict[str, str]:
        return {**os.environ, "PYTHONPATH": str(REPO_ROOT), "GLOO_SOCKET_IFNAME": "eth0", "OMP_NUM_THREADS": "1",
                **(extra or {})}
