"""The Slurm target: an `sbatch` allocation, the node agents started in it by `srun` (launcher.py;
docs/slurm.md). Its record and option rows; the launcher imports the spec, so it is named as a string."""
from sdp_jupyter.launch.options import Option
from sdp_jupyter.launch.targets.record import FormField, Target

OPTIONS = (
    Option("--partition", "slurm.partition", "--target slurm: the partition (sbatch -p; default: the cluster's)",
           metavar="NAME"),
    Option("--account", "slurm.account", "--target slurm: the account charged (sbatch -A)", metavar="NAME"),
    Option("--time", "slurm.time", "--target slurm: the allocation's wall-clock limit, as Slurm writes it "
           "(30, 1:30:00, 2-0)", metavar="LIMIT"),
    Option("--slurm-args", "slurm.args", '--target slurm: more sbatch options, e.g. --slurm-args "--qos=high '
           '--constraint=v100"', metavar="ARGS"),
)
KEYS = frozenset({"partition", "account", "time", "args"})

RECORD = Target(
    "slurm", ".launcher:SlurmLauncher", "slurm", "sdp_jupyter.launch.targets.slurm:OPTIONS", KEYS,
    # empty fields are left out of the spec, so Slurm's default holds
    form=(FormField("slurm_partition", OPTIONS[0], "Partition", "the cluster's default (sbatch -p)"),
          FormField("slurm_account", OPTIONS[1], "Account", "your default (sbatch -A)"),
          FormField("slurm_time", OPTIONS[2], "Time limit", "the partition's (30, 1:30:00, 2-0)"),
          FormField("slurm_args", OPTIONS[3], "More sbatch options", "--qos=high --gpus-per-node=8")),
    exclusive=True, sessions=True, own_hosts=True, elastic=True, heal=True)
