"""The Ray target: one node agent per Ray node, in an actor (launcher.py, actors.py; docs/ray.md).
Its record and option rows; the launcher imports the spec, so it is named as a string."""
from sdp_jupyter.launch.options import Option
from sdp_jupyter.launch.targets.record import FormField, Target

OPTIONS = (
    Option("--address", "ray.address",
           "--target ray: the cluster, HOST:PORT, auto or ray://HOST:10001 (default: $RAY_ADDRESS, else auto)",
           metavar="ADDRESS"),
)
KEYS = frozenset({"address"})

RECORD = Target(
    "ray", ".launcher:RayLauncher", "ray", "sdp_jupyter.launch.targets.ray:OPTIONS", KEYS,
    form=(FormField("ray_address", OPTIONS[0], "Ray address", "$RAY_ADDRESS, else auto (HOST:6379, ray://...)"),),
    warm=True, exclusive=True, sessions=True, own_hosts=True, elastic=True, heal=True)
