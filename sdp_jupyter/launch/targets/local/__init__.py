"""The local target (the default): every node an agent on this machine, a child of the kernel over a
pipe (launcher.py)."""
from sdp_jupyter.launch.targets.record import Target

RECORD = Target("local", ".launcher:LocalLauncher", warm=True, sessions=True, hybrid=True, heal=True, elastic=True,
                this_machine=True)
