import pytest

from contracts.cluster import ClusterSpec
from profiler import inventory, slurm_inventory
from profiler.inventory import LocalDevice, build_local_cluster, detect_devices


def _no_cuda(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_detect_devices_without_cuda_reports_the_cpu(monkeypatch):
    _no_cuda(monkeypatch)
    (cpu,) = detect_devices()
    assert cpu.kind == "cpu" and cpu.catalog_type == "cpu"
    assert cpu.num_cores == inventory.usable_cores() >= 1
    assert cpu.memory_bytes > 2**28 and cpu.name
    assert cpu.compute_capability is None and cpu.num_sms is None


def test_local_cluster_without_cuda_has_a_cpu_worker_per_core_but_at_least_two(monkeypatch):
    _no_cuda(monkeypatch)
    c = build_local_cluster()
    (node,) = c.nodes
    assert (node.name, node.datacenter) == ("localhost", "local")
    assert c.device_types() == ["cpu"] and not c.emulated
    assert c.num_devices == max(2, inventory.usable_cores())
    one_core = [LocalDevice("cpu", 0, "x", "cpu", 2**33, num_cores=1)]
    assert build_local_cluster(one_core).num_devices == 2
    eight = [LocalDevice("cpu", 0, "x", "cpu", 2**33, num_cores=8)]
    assert build_local_cluster(eight).num_devices == 8
    assert ClusterSpec.from_json(c.to_json()) == c


def test_gpus_become_one_device_each_with_their_catalog_type():
    gpus = [LocalDevice("cuda", i, "NVIDIA H200", "H200", 150_000_000_000, "9.0", 132) for i in range(2)]
    gpus.append(LocalDevice("cuda", 2, "Tesla T4", "T4", 15 * 2**30, "7.5", 40))
    c = build_local_cluster(gpus)
    assert [d.type for _, d in c.devices()] == ["H200", "H200", "T4"]
    assert c.nodes[0].datacenter == "local"


def test_unknown_gpu_falls_back_to_the_closest_catalog_type_by_memory():
    assert inventory._closest_catalog_type(80 * 2**30) in ("A100-80GB", "H100-SXM", "H100-PCIe")
    assert inventory._closest_catalog_type(16 * 2**30) in ("V100-16GB", "T4", "P100")


# ---- SLURM: parsers on outputs captured from the real test cluster (testkit/slurm.py, SLURM 22.05.8) ----

SCONTROL_NODES_D = "\n".join((
    'NodeName=n1 Arch=x86_64 CoresPerSocket=1  CPUAlloc=1 CPUEfctv=2 CPUTot=2 CPULoad=7.71 AvailableFeatures=(null) ActiveFeatures=(null) Gres=gpumix:cpu:2 GresDrain=N/A GresUsed=gpumix:cpu:1 NodeAddr=10.77.0.2 NodeHostName=n1 Version=22.05.8 OS=Linux 6.18.44-fc-v857 #1 SMP PREEMPT_DYNAMIC @0  RealMemory=1000 AllocMem=0 FreeMem=20744 Sockets=2 Boards=1 State=MIXED ThreadsPerCore=1 TmpDisk=0 Weight=1 Owner=N/A MCS_label=N/A Partitions=debug  BootTime=2026-12-01T08:22:00 SlurmdStartTime=2026-12-01T11:25:20 LastBusyTime=2026-12-01T11:25:20 CfgTRES=cpu=2,mem=1000M,billing=2 AllocTRES=cpu=1 CapWatts=n/a CurrentWatts=0 AveWatts=0 ExtSensorsJoules=n/s ExtSensorsWatts=0 ExtSensorsTemp=n/s',
    'NodeName=n2 Arch=x86_64 CoresPerSocket=1  CPUAlloc=0 CPUEfctv=2 CPUTot=2 CPULoad=7.71 AvailableFeatures=(null) ActiveFeatures=(null) Gres=gpumix:cpu:1 GresDrain=N/A GresUsed=gpumix:cpu:0 NodeAddr=10.77.0.3 NodeHostName=n2 Version=22.05.8 OS=Linux 6.18.44-fc-v857 #1 SMP PREEMPT_DYNAMIC @0  RealMemory=1000 AllocMem=0 FreeMem=20744 Sockets=2 Boards=1 State=IDLE ThreadsPerCore=1 TmpDisk=0 Weight=1 Owner=N/A MCS_label=N/A Partitions=debug  BootTime=2026-12-01T08:22:00 SlurmdStartTime=2026-12-01T11:25:20 LastBusyTime=2026-12-01T11:25:20 CfgTRES=cpu=2,mem=1000M,billing=2 AllocTRES= CapWatts=n/a CurrentWatts=0 AveWatts=0 ExtSensorsJoules=n/s ExtSensorsWatts=0 ExtSensorsTemp=n/s',
))  # `scontrol -d show node -o`, a job holding 1 of n1's 2 GRES
SCONTROL_NODE_DOWN = 'NodeName=n2 Arch=x86_64 CoresPerSocket=1  CPUAlloc=1 CPUEfctv=2 CPUTot=2 CPULoad=7.92 AvailableFeatures=(null) ActiveFeatures=(null) Gres=gpumix:cpu:1 NodeAddr=10.77.0.3 NodeHostName=n2 Version=22.05.8 OS=Linux 6.18.44-fc-v857 #1 SMP PREEMPT_DYNAMIC @0  RealMemory=1000 AllocMem=0 FreeMem=20646 Sockets=2 Boards=1 State=MIXED+NOT_RESPONDING ThreadsPerCore=1 TmpDisk=0 Weight=1 Owner=N/A MCS_label=N/A Partitions=debug  BootTime=2026-12-01T08:21:59 SlurmdStartTime=2026-12-01T11:24:46 LastBusyTime=2026-12-01T11:24:46 CfgTRES=cpu=2,mem=1000M,billing=2 AllocTRES=cpu=1 CapWatts=n/a CurrentWatts=0 AveWatts=0 ExtSensorsJoules=n/s ExtSensorsWatts=0 ExtSensorsTemp=n/s'  # n2 after its slurmd was killed
SINFO_NODES = "n1|debug*|mixed\nn2|debug*|mixed\nn2|long|mixed\n"  # `sinfo -h -N -o "%N|%P|%T"`, n2 in 2 partitions
SCONTROL_HETJOB_RUNNING = "\n".join((
    'JobId=1 HetJobId=1 HetJobOffset=0 JobName=b.sh HetJobIdSet=1-2 UserId=root(0) GroupId=root(0) MCS_label=N/A Priority=4294901759 Nice=0 Account=(null) QOS=(null) JobState=RUNNING Reason=None Dependency=(null) Requeue=1 Restarts=0 BatchFlag=1 Reboot=0 ExitCode=0:0 RunTime=00:00:03 TimeLimit=UNLIMITED TimeMin=N/A SubmitTime=2026-12-01T11:24:47 EligibleTime=2026-12-01T11:24:47 AccrueTime=2026-12-01T11:24:47 StartTime=2026-12-01T11:24:47 EndTime=Unknown Deadline=N/A SuspendTime=None SecsPreSuspend=0 LastSchedEval=2026-12-01T11:24:47 Scheduler=Backfill Partition=debug AllocNode:Sid=localhost:14238 ReqNodeList=n1 ExcNodeList=n2 NodeList=n1 BatchHost=n1 NumNodes=1 NumCPUs=1 NumTasks=1 CPUs/Task=1 ReqB:S:C:T=0:0:*:* TRES=cpu=1,node=1,billing=1 Socks/Node=* NtasksPerN:B:S:C=0:0:*:* CoreSpec=* MinCPUsNode=1 MinMemoryNode=0 MinTmpDiskNode=0 Features=(null) DelayBoot=00:00:00 OverSubscribe=OK Contiguous=0 Licenses=(null) Network=(null) Command=/srv/gpumix/b.sh WorkDir=/srv/gpumix StdErr=/dev/null StdIn=/dev/null StdOut=/dev/null Power= TresPerNode=gres:gpumix:cpu:2 ',
    'JobId=2 HetJobId=1 HetJobOffset=1 JobName=b.sh HetJobIdSet=1-2 UserId=root(0) GroupId=root(0) MCS_label=N/A Priority=4294901758 Nice=0 Account=(null) QOS=(null) JobState=RUNNING Reason=None Dependency=(null) Requeue=1 Restarts=0 BatchFlag=1 Reboot=0 ExitCode=0:0 RunTime=00:00:03 TimeLimit=UNLIMITED TimeMin=N/A SubmitTime=2026-12-01T11:24:47 EligibleTime=2026-12-01T11:24:47 AccrueTime=2026-12-01T11:24:47 StartTime=2026-12-01T11:24:47 EndTime=Unknown Deadline=N/A SuspendTime=None SecsPreSuspend=0 LastSchedEval=2026-12-01T11:24:47 Scheduler=Backfill Partition=debug AllocNode:Sid=localhost:14238 ReqNodeList=n2 ExcNodeList=n1 NodeList=n2 BatchHost=n2 NumNodes=1 NumCPUs=1 NumTasks=1 CPUs/Task=1 ReqB:S:C:T=0:0:*:* TRES=cpu=1,node=1,billing=1 Socks/Node=* NtasksPerN:B:S:C=0:0:*:* CoreSpec=* MinCPUsNode=1 MinMemoryNode=0 MinTmpDiskNode=0 Features=(null) DelayBoot=00:00:00 OverSubscribe=OK Contiguous=0 Licenses=(null) Network=(null) Command=/srv/gpumix/b.sh WorkDir=/srv/gpumix StdErr=/dev/null StdIn=/dev/null StdOut=/dev/null Power= TresPerNode=gres:gpumix:cpu:1 ',
))
SCONTROL_HETJOB_CANCELLED = "\n".join((
    'JobId=1 HetJobId=1 HetJobOffset=0 JobName=b.sh HetJobIdSet=1-2 UserId=root(0) GroupId=root(0) MCS_label=N/A Priority=4294901759 Nice=0 Account=(null) QOS=(null) JobState=CANCELLED Reason=None Dependency=(null) Requeue=1 Restarts=0 BatchFlag=1 Reboot=0 ExitCode=0:15 RunTime=00:00:15 TimeLimit=UNLIMITED TimeMin=N/A SubmitTime=2026-12-01T11:24:47 EligibleTime=2026-12-01T11:24:47 AccrueTime=2026-12-01T11:24:47 StartTime=2026-12-01T11:24:47 EndTime=2026-12-01T11:25:02 Deadline=N/A SuspendTime=None SecsPreSuspend=0 LastSchedEval=2026-12-01T11:24:47 Scheduler=Backfill Partition=debug AllocNode:Sid=localhost:14238 ReqNodeList=n1 ExcNodeList=n2 NodeList=n1 BatchHost=n1 NumNodes=1 NumCPUs=1 NumTasks=1 CPUs/Task=1 ReqB:S:C:T=0:0:*:* TRES=cpu=1,node=1,billing=1 Socks/Node=* NtasksPerN:B:S:C=0:0:*:* CoreSpec=* MinCPUsNode=1 MinMemoryNode=0 MinTmpDiskNode=0 Features=(null) DelayBoot=00:00:00 OverSubscribe=OK Contiguous=0 Licenses=(null) Network=(null) Command=/srv/gpumix/b.sh WorkDir=/srv/gpumix StdErr=/dev/null StdIn=/dev/null StdOut=/dev/null Power= TresPerNode=gres:gpumix:cpu:2 ',
    'JobId=2 HetJobId=1 HetJobOffset=1 JobName=b.sh HetJobIdSet=1-2 UserId=root(0) GroupId=root(0) MCS_label=N/A Priority=4294901758 Nice=0 Account=(null) QOS=(null) JobState=COMPLETING Reason=None Dependency=(null) Requeue=1 Restarts=0 BatchFlag=1 Reboot=0 ExitCode=0:15 RunTime=00:00:15 TimeLimit=UNLIMITED TimeMin=N/A SubmitTime=2026-12-01T11:24:47 EligibleTime=2026-12-01T11:24:47 AccrueTime=2026-12-01T11:24:47 StartTime=2026-12-01T11:24:47 EndTime=2026-12-01T11:25:02 Deadline=N/A SuspendTime=None SecsPreSuspend=0 LastSchedEval=2026-12-01T11:24:47 Scheduler=Backfill Partition=debug AllocNode:Sid=localhost:14238 ReqNodeList=n2 ExcNodeList=n1 NodeList=n2 BatchHost=n2 NumNodes=1 NumCPUs=1 NumTasks=1 CPUs/Task=1 ReqB:S:C:T=0:0:*:* TRES=cpu=1,node=1,billing=1 Socks/Node=* NtasksPerN:B:S:C=0:0:*:* CoreSpec=* MinCPUsNode=1 MinMemoryNode=0 MinTmpDiskNode=0 Features=(null) DelayBoot=00:00:00 OverSubscribe=OK Contiguous=0 Licenses=(null) Network=(null) Command=/srv/gpumix/b.sh WorkDir=/srv/gpumix StdErr=/dev/null StdIn=/dev/null StdOut=/dev/null Power= TresPerNode=gres:gpumix:cpu:1 ',
))  # component 1 still COMPLETING
# the `Gres=` field of a GPU site's node, in SLURM's documented form (typed, socket bindings)
GPU_SITE_GRES = "gpu:a100:4(S:0-1),gpu:v100:2(S:1),gpumix:cpu:1"


def test_scontrol_node_fields_keep_values_with_spaces():
    f = slurm_inventory.parse_fields(SCONTROL_NODES_D.splitlines()[0])
    assert f["NodeName"] == "n1" and f["NodeAddr"] == "10.77.0.2" and f["State"] == "MIXED"
    assert f["OS"] == "Linux 6.18.44-fc-v857 #1 SMP PREEMPT_DYNAMIC @0"
    assert f["Gres"] == "gpumix:cpu:2" and f["GresUsed"] == "gpumix:cpu:1"


def test_nodes_from_scontrol():
    n1, n2 = slurm_inventory.parse_nodes(SCONTROL_NODES_D, "gpumix")
    assert (n1.name, n1.addr, n1.gres, n1.gres_used, n1.cpus, n1.memory_mb) == (
        "n1", "10.77.0.2", {"cpu": 2}, {"cpu": 1}, 2, 1000)
    assert (n2.name, n2.addr, n2.gres, n2.gres_used, n2.state) == ("n2", "10.77.0.3", {"cpu": 1}, {"cpu": 0}, "IDLE")
    assert n1.usable and n2.usable and n1.partitions == ("debug",)
    (dead,) = slurm_inventory.parse_nodes(SCONTROL_NODE_DOWN, "gpumix")
    assert dead.state == "MIXED+NOT_RESPONDING" and not dead.usable
    assert slurm_inventory.parse_nodes(SCONTROL_NODES_D, "gpu")[0].gres == {}  # another site's GRES name


def test_gres_fields():
    assert slurm_inventory.parse_gres(GPU_SITE_GRES, "gpu") == {"a100": 4, "v100": 2}
    assert slurm_inventory.parse_gres(GPU_SITE_GRES, "gpumix") == {"cpu": 1}
    assert slurm_inventory.parse_gres("gpu:2", "gpu") == {"": 2}
    assert slurm_inventory.parse_gres("(null)", "gpu") == {}
    assert slurm_inventory.parse_gres("gpu:a100:2(IDX:0-1),gpu:a100:1(IDX:3)", "gpu") == {"a100": 3}


def test_partitions_from_sinfo():
    assert slurm_inventory.parse_sinfo_partitions(SINFO_NODES) == {"n1": ("debug",), "n2": ("debug", "long")}


def test_gres_types_become_catalog_types_or_are_refused():
    ct = slurm_inventory.catalog_type
    assert ct("cpu") == "cpu" and ct("h200") == "H200" and ct("A100-80gb") == "A100-80GB"
    with pytest.raises(ValueError, match="V100-16GB or V100-32GB"):
        ct("v100")  # two sizes: never guessed
    assert ct("v100", {"v100": "V100-32GB"}) == "V100-32GB"
    with pytest.raises(ValueError, match="untyped"):
        ct("")
    with pytest.raises(ValueError, match="GRES_TYPE=CATALOG_TYPE"):
        slurm_inventory.parse_type_map(["v100=V100"])


def test_cluster_file_from_the_nodes_skips_down_ones():
    nodes = slurm_inventory.parse_nodes(SCONTROL_NODES_D, "gpumix")
    cluster = slurm_inventory.build_slurm_cluster(nodes, "slurm-gpumix")
    assert [(n.name, [d.type for d in n.devices]) for n in cluster.nodes] == [("n1", ["cpu", "cpu"]), ("n2", ["cpu"])]
    assert ClusterSpec.from_dict(cluster.to_dict()).num_devices == 3  # a valid cluster file
    dead = slurm_inventory.parse_nodes(SCONTROL_NODE_DOWN, "gpumix")
    assert [n.name for n in slurm_inventory.build_slurm_cluster(nodes[:1] + dead).nodes] == ["n1"]
    with pytest.raises(ValueError, match="no usable SLURM node"):
        slurm_inventory.build_slurm_cluster(dead)


def test_job_state_of_a_heterogeneous_job():
    from executor.slurm_job import expand_hostlist, parse_job

    running = parse_job(SCONTROL_HETJOB_RUNNING, "1")
    assert running.state == "RUNNING" and running.active and running.nodes == ("n1", "n2")
    ending = parse_job(SCONTROL_HETJOB_CANCELLED, "1")
    assert ending.state == "COMPLETING" and ending.completing and not ending.active  # one component cleans up
    gone = parse_job("", "1")
    assert not gone.known and not gone.active
    assert expand_hostlist("n[1-3,5],gpu07,a[08-10]") == ["n1", "n2", "n3", "n5", "gpu07", "a08", "a09", "a10"]


