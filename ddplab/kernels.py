"""How the kit's Jupyter kernels meet their clients: over Unix sockets, never a chosen port.

Jupyter's default transport, tcp, has a race built in (jupyter/jupyter_client#154): the
client picks five free ports (binds each to port 0 and closes it), writes them into the
kernel's connection file, and starts the kernel, which binds them only a second or two
later, once Python and ipykernel are imported. Any other process that binds a port in
that window may get one of the five. The kernel then dies before it answers
`kernel_info`, and every cell of the notebook fails. On a machine where the kit runs, that
window is crowded: every pool rank's gloo device, every TCPStore, every launcher binds a
port the operating system picks from the same range. In the kit's own CI a kernel died this
way in about one full run in ten.

The ipc transport has no window: the kernel binds Unix sockets at paths its client chose,
and no other program picks those paths. The paths sit beside the kernel's connection file,
in Jupyter's runtime folder (private to the user: mode 0700), as Jupyter itself places
them, and Jupyter removes both when the kernel shuts down. A Unix socket's path must be
short (103 bytes on macOS, 107 on Linux); where the runtime folder is too deep for that (a
long home folder, a test's temporary folder) the sockets go to a private folder of their
own in the temporary directory instead, removed with them.

`IpcProvisioner` is a jupyter_client kernel provisioner (registered as "ddplab-ipc" in
pyproject.toml) that starts kernels exactly as Jupyter's own `LocalProvisioner` does, but
over ipc. `use_ipc()` makes it the default for every kernel this process and its children
start (JupyterLab's, nbval's, nbclient's, a test's `KernelManager`) through
`JUPYTER_DEFAULT_PROVISIONER_NAME`, jupyter_client's documented switch, so none of them is
changed or wrapped. tcp stays where a user needs it: a variable the user set wins, a kernel
spec that names its own provisioner keeps it, a kernel other than ipykernel keeps tcp, and
a manager configured for an address other than this machine's is left alone.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from importlib.metadata import entry_points
from typing import Any

from jupyter_client.localinterfaces import is_local_ip
from jupyter_client.provisioning import LocalProvisioner
from jupyter_core.paths import jupyter_runtime_dir

PROVISIONER = "ddplab-ipc"
"""The name pyproject.toml registers `IpcProvisioner` under."""
DEFAULT_PROVISIONER_VARIABLE = "JUPYTER_DEFAULT_PROVISIONER_NAME"
"""jupyter_client's switch for the provisioner of kernel specs that name none."""
MAX_SOCKET_PATH = 100
"""The longest ipc path used: under macOS's 103 bytes, with room for the port's suffix."""
PRIVATE_FOLDER_PREFIX = "ddplab-kernel-"
"""The name of a private folder for the sockets of a kernel whose runtime folder is too deep."""


def fits(prefix: str) -> bool:
    """Whether the sockets `<prefix>-1` to `<prefix>-5` have paths Unix accepts."""
    return len(os.fsencode(prefix)) + len("-99") <= MAX_SOCKET_PATH  # bytes, not characters


def ipc_prefix(connection_file: str) -> str | None:
    """Where a kernel's ipc sockets go, `<prefix>-1` to `<prefix>-5`: beside its connection
    file (Jupyter's own choice for ipc); else in a new private folder (mode 0700) in the
    temporary directory; None if even that is too deep (tcp, then)."""
    prefix = os.path.splitext(connection_file)[0] + "-ipc"
    if fits(prefix):
        return prefix
    prefix = os.path.join(tempfile.gettempdir(), PRIVATE_FOLDER_PREFIX + "XXXXXXXX", "k")
    if not fits(prefix):
        return None
    return os.path.join(tempfile.mkdtemp(prefix=PRIVATE_FOLDER_PREFIX), "k")


def speaks_ipc(argv: list[str]) -> bool:
    """Whether a kernel spec's command starts ipykernel, which binds the ipc addresses its
    connection file names. Other kernels (IRkernel, IJulia) may build `tcp://ip:port` from
    the file whatever its transport: they keep tcp."""
    return any("ipykernel" in word for word in argv)


class IpcProvisioner(LocalProvisioner):
    """Jupyter's local provisioner, with the kernel's channels on Unix sockets."""

    async def pre_launch(self, **kwargs: Any) -> dict[str, Any]:
        km = self.parent
        if (km is not None and km.transport == "tcp" and is_local_ip(km.ip)
                and speaks_ipc(self.kernel_spec.argv)):
            if not km.connection_file:  # a lone manager (nbval, nbclient) names none
                runtime = jupyter_runtime_dir()
                os.makedirs(runtime, mode=0o700, exist_ok=True)
                km.connection_file = os.path.join(runtime, f"kernel-{self.kernel_id}.json")
            prefix = ipc_prefix(km.connection_file)
            if prefix is not None:
                km.transport = "ipc"
                km.ip = prefix
                km.cache_ports = False  # the port cache binds tcp ports; ipc takes none
        return await super().pre_launch(**kwargs)

    def _finalize_env(self, env: dict[str, str]) -> None:
        """The kernel's environment, without our default: its own children (a Jupyter of
        another environment, started from a cell) choose a provisioner afresh, and ours
        may not be installed where they look."""
        super()._finalize_env(env)
        if env.get(DEFAULT_PROVISIONER_VARIABLE) == PROVISIONER:
            del env[DEFAULT_PROVISIONER_VARIABLE]

    async def cleanup(self, restart: bool = False) -> None:
        """After Jupyter has removed the sockets: a private folder of ours goes too (a
        restart keeps it, for the same paths)."""
        await super().cleanup(restart=restart)
        km = self.parent
        if restart or km is None or km.transport != "ipc":
            return
        folder = os.path.dirname(km.ip)
        if os.path.basename(folder).startswith(PRIVATE_FOLDER_PREFIX):
            with contextlib.suppress(OSError):
                os.rmdir(folder)


def registered() -> bool:
    """Whether `IpcProvisioner` is installed where jupyter_client looks for provisioners
    (the package's entry points; a bare checkout on `sys.path` has none)."""
    found = entry_points(group="jupyter_client.kernel_provisioners", name=PROVISIONER)
    return any(ep.value.startswith(__name__ + ":") for ep in found)


def use_ipc() -> bool:
    """Make `IpcProvisioner` the default for kernels started from now on, by this process
    and the processes it starts. Returns whether kernels will use it.

    A provisioner the user chose (the variable already set) is kept. Call it before the
    first kernel starts: jupyter_client reads the variable once per process.
    """
    chosen = os.environ.get(DEFAULT_PROVISIONER_VARIABLE)
    if chosen is not None:
        return chosen == PROVISIONER
    if not registered():
        return False
    os.environ[DEFAULT_PROVISIONER_VARIABLE] = PROVISIONER
    return True
