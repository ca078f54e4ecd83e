"""``--emit kubernetes``: a ConfigMap holding the job file and a JobSet (https://jobset.sigs.k8s.io, the API Kubeflow
Trainer v2 runs its TrainJobs on) with one replicated job per island: its pods, the vendor's device resource, the
island's environment and a torchrun that joins one c10d rendezvous at the first pod of island 0 (JobSet's stable pod
host names). The run directory is a PersistentVolumeClaim every pod mounts at the path the job names (checkpoints
outlive pods); the image and the claim are placeholders to edit."""
from __future__ import annotations

from typing import Any

import yaml

from hal.parallel.config.job import Job, job_text

from .components import RDZV_PORT, Layout, components, rank_env, torchrun_args

JOB_MOUNT = "/etc/hal"
IMAGE = "REPLACE-with-an-image-holding-hetero-hal-and-the-vendor-runtime"
CLAIM = "hal-runs"


def resources(job: Job, layout: Layout) -> list[dict[str, Any]]:
    """The two resources, as data (``emit`` writes them as one YAML List)."""
    parts = components(job, layout)
    name = layout.job_name
    first = parts[0]
    endpoint = f"{name}-{first.name}-0-0.{name}:{RDZV_PORT}"
    config = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": f"{name}-job"},
              "data": {"job.json": job_text(job)}}
    replicated = []
    for c in parts:
        args = torchrun_args(job, parts, c, endpoint, name)
        args[-1] = f"{JOB_MOUNT}/job.json"  # the trainer reads the job file from the ConfigMap
        container: dict[str, Any] = {
            "name": "trainer", "image": IMAGE, "command": ["torchrun", *args],
            "env": [{"name": k, "value": v} for k, v in rank_env(job, c).items()],
            "volumeMounts": [{"name": "job", "mountPath": JOB_MOUNT, "readOnly": True},
                             {"name": "runs", "mountPath": str(job.run_dir)}],
        }
        if c.resource:
            container["resources"] = {"limits": {c.resource: c.per_node}}
        pod = {"restartPolicy": "Never", "containers": [container],
               "volumes": [{"name": "job", "configMap": {"name": f"{name}-job"}},
                           {"name": "runs", "persistentVolumeClaim": {"claimName": CLAIM}}]}
        replicated.append({"name": c.name, "replicas": 1, "template": {"spec": {
            "parallelism": c.nodes, "completions": c.nodes, "completionMode": "Indexed", "backoffLimit": 0,
            "template": {"metadata": {"labels": {"hal/island": str(c.index), "hal/backend": c.backend}}, "spec": pod}}}})
    jobset = {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet", "metadata": {"name": name},
              "spec": {"network": {"enableDNSHostnames": True}, "failurePolicy": {"maxRestarts": 3},
                       "replicatedJobs": replicated}}
    return [config, jobset]


def emit(job: Job, layout: Layout) -> str:
    head = ("# hal train as Kubernetes resources: the job file (ConfigMap) and a JobSet, one replicated job per island.\n"
            f"# Edit the image ({IMAGE}) and the claim ({CLAIM}); then kubectl apply -f this file.\n")
    doc = {"apiVersion": "v1", "kind": "List", "items": resources(job, layout)}
    return head + yaml.safe_dump(doc, sort_keys=False, width=120)
