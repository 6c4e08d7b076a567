"""The seed report's job: a megatron-core checkpoint saved inside a Ray actor.

    python ray_actor_save.py CKPT_DIR RAY_TEMP_DIR

Starts a local Ray cluster on loopback (one CPU, no dashboard), creates one actor (a worker
process that Ray's raylet starts: not a fork of this driver), and has it run
examples/checkpoint_job.py's save and load there, with the megatron-core installed in this
venv. Neither this driver nor the actor imports mcore_autopatch; whatever fixes the save in
the actor is the installed ``.pth``. Prints one JSON line: the job's result, plus where it
ran. Stops the cluster before exiting.
"""

import json
import os
import sys

import ray

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
JOB = os.path.join(ROOT, "examples", "checkpoint_job.py")


@ray.remote(num_cpus=1)
class CheckpointActor:
    def save_and_load(self, job_path: str, folder: str) -> dict:
        import importlib.util

        spec = importlib.util.spec_from_file_location("checkpoint_job", job_path)
        job = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(job)
        result = job.job(job.parse_args(["--dir", folder]))
        with open("/proc/%d/comm" % os.getppid()) as f:
            parent = f.read().strip()
        megatron = sys.modules["megatron.core"]
        result.update(
            actor_pid=os.getpid(),
            actor_parent=parent,
            megatron_core_file=megatron.__file__,
            startup_hook_ran="mcore_autopatch" in sys.modules,
        )
        return result


def main() -> int:
    folder, temp_dir = sys.argv[1], sys.argv[2]
    ray.init(
        num_cpus=1,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        _temp_dir=temp_dir,
        log_to_driver=False,
        configure_logging=False,
    )
    try:
        actor = CheckpointActor.remote()
        result = ray.get(actor.save_and_load.remote(JOB, folder), timeout=600)
        result["driver_pid"] = os.getpid()
        result["driver_imported_megatron"] = "megatron" in sys.modules
    finally:
        ray.shutdown()
    print(json.dumps(result, sort_keys=True, default=str), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
