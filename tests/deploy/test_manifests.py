"""deploy/k8s: both overlays render with ``kubectl kustomize``, every core object validates
against Kubernetes' own schema (``kubernetes-validate``, strict), the KEDA objects against
the fields KEDA documents (``keda_schema.json``), and the invariants the deployment relies on
hold: grace period > the worker's drain, startup budget >= the measured cold start, a
memory-backed /dev/shm, no plaintext secret, Redis reachable only from fleet pods, and KEDA
targets derived from the measured service rates (``deploy/k8s/measured.json``) and
max_batch_size.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from shared.acl import rules
from shared.metrics import metrics_port
from shared.settings import MODALITIES, Settings

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"
OVERLAYS = ("cpu", "gpu")
KUBERNETES_VERSION = "1.30"  # the oldest minor still in common managed offerings
KEDA_KINDS = {"ScaledObject", "TriggerAuthentication"}
MEASURED = json.loads((K8S / "measured.json").read_text())
# After the drain window the worker still gives its held messages back and closes its
# connections: the grace period must cover that too.
GIVE_BACK_MARGIN_S = 10
# Nodes slower or busier than the one measured: the startup probe allows this many times the
# measured cold start before the kubelet kills a loading worker.
STARTUP_SAFETY = 5
SECRET_ENV = re.compile(r"PASSWORD|TOKEN|SECRET|AUTH", re.IGNORECASE)


def render(overlay: str) -> list[dict[str, Any]]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip(
            "kubectl is not installed (.ci/run installs it: apt-get install kubernetes-client)"
        )
    out = subprocess.run(
        [kubectl, "kustomize", str(K8S / "overlays" / overlay)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


@pytest.fixture(scope="module", params=OVERLAYS)
def objects(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    return render(request.param)


def of_kind(objs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in objs if o["kind"] == kind}


def workers(objs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Worker Deployments by modality."""
    deps = of_kind(objs, "Deployment")
    return {m: deps[f"worker-{m}"] for m in MODALITIES}


def container(dep: dict[str, Any]) -> dict[str, Any]:
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    return c


def pod_settings(c: dict[str, Any]) -> Settings:
    """The settings the container's process loads: its FLEET_* env, /app as this repo."""
    env = {e["name"]: e.get("value", "") for e in c.get("env", []) if "value" in e}
    config = env.pop("FLEET_CONFIG").replace("/app/", f"{REPO}/")
    fleet = {k: v for k, v in env.items() if k.startswith("FLEET_")}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FLEET_CONFIG", config)
        for k, v in fleet.items():
            mp.setenv(k, v)
        return Settings()


# -- rendering and schemas ------------------------------------------------------------------
def test_both_overlays_render_every_part(objects: list[dict[str, Any]]) -> None:
    kinds = {(o["kind"], o["metadata"]["name"]) for o in objects}
    expected = {
        ("StatefulSet", "redis"),
        ("Service", "redis"),
        ("Deployment", "gateway"),
        ("Service", "gateway"),
        ("Deployment", "flower"),
        ("Service", "flower"),
        ("Deployment", "exporter"),
        ("Service", "exporter"),
        ("NetworkPolicy", "redis-from-fleet-only"),
        ("TriggerAuthentication", "fleet-prometheus"),
        *(("Deployment", f"worker-{m}") for m in MODALITIES),
        *(("ScaledObject", f"worker-{m}") for m in MODALITIES),
    }
    assert expected <= kinds
    assert all(
        o["metadata"].get("namespace") == "mmfleet" for o in objects if o["kind"] != "Namespace"
    )


def test_every_core_object_is_valid_kubernetes(objects: list[dict[str, Any]]) -> None:
    core = [o for o in objects if o["kind"] not in KEDA_KINDS]
    assert len(core) >= 14
    for o in core:
        # raises ValidationError (with the path) on a wrong or unknown field
        kubernetes_validate.validate(o, KUBERNETES_VERSION, strict=True)


def test_keda_objects_have_only_the_fields_keda_documents(objects: list[dict[str, Any]]) -> None:
    schema = json.loads((Path(__file__).parent / "keda_schema.json").read_text())
    keda = [o for o in objects if o["kind"] in KEDA_KINDS]
    assert {o["kind"] for o in keda} == KEDA_KINDS
    for o in keda:
        jsonschema.validate(o, {**schema, "$ref": f"#/$defs/{o['kind']}"})


def test_the_keda_schema_refuses_a_misspelt_field() -> None:
    schema = json.loads((Path(__file__).parent / "keda_schema.json").read_text())
    so = of_kind(render("cpu"), "ScaledObject")["worker-text"]
    so["spec"]["cooldownPeriods"] = 300
    with pytest.raises(jsonschema.ValidationError, match="cooldownPeriods"):
        jsonschema.validate(so, {**schema, "$ref": "#/$defs/ScaledObject"})


# -- workers --------------------------------------------------------------------------------
def test_the_grace_period_outlasts_the_workers_drain(objects: list[dict[str, Any]]) -> None:
    for m, dep in workers(objects).items():
        drain_s = pod_settings(container(dep)).modality(m).soft_shutdown_timeout_s
        grace_s = dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        assert grace_s >= drain_s + GIVE_BACK_MARGIN_S, m


def test_probes_read_the_port_the_worker_opens_after_warmup(objects: list[dict[str, Any]]) -> None:
    for m, dep in workers(objects).items():
        c = container(dep)
        s = pod_settings(c)
        port = metrics_port(s, m)
        assert port is not None and s.metrics.host == "0.0.0.0", m  # the kubelet reaches it
        named = {p["name"]: p["containerPort"] for p in c["ports"]}
        for probe in ("startupProbe", "readinessProbe"):
            get = c[probe]["httpGet"]
            assert get["path"] == "/metrics" and named[get["port"]] == port, (m, probe)


def test_the_startup_probe_waits_out_the_measured_cold_start(
    objects: list[dict[str, Any]],
) -> None:
    for m, dep in workers(objects).items():
        p = container(dep)["startupProbe"]
        budget_s = p.get("initialDelaySeconds", 0) + p["periodSeconds"] * p["failureThreshold"]
        cold_s = MEASURED["modalities"][m]["cold_start_s"]
        assert budget_s >= STARTUP_SAFETY * cold_s, (m, budget_s, cold_s)


def test_dev_shm_is_memory_backed(objects: list[dict[str, Any]]) -> None:
    for m, dep in workers(objects).items():
        spec = dep["spec"]["template"]["spec"]
        (mount,) = [v for v in container(dep)["volumeMounts"] if v["mountPath"] == "/dev/shm"]
        (vol,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
        assert vol["emptyDir"]["medium"] == "Memory", m
        limit = container(dep)["resources"]["limits"]["memory"]
        assert _bytes(vol["emptyDir"]["sizeLimit"]) < _bytes(limit), m  # shm pages count there


def test_gpu_workers_request_a_gpu_and_cpu_workers_none() -> None:
    for overlay, want in (("cpu", None), ("gpu", "1")):
        for m, dep in workers(render(overlay)).items():
            res = container(dep)["resources"]
            assert res["limits"].get("nvidia.com/gpu") == want, (overlay, m)
            cfg = next(e["value"] for e in container(dep)["env"] if e["name"] == "FLEET_CONFIG")
            assert ("gpu.toml" in cfg) == (overlay == "gpu"), (overlay, m)


def _bytes(q: str) -> int:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
    for u, f in units.items():
        if q.endswith(u):
            return int(q[: -len(u)]) * f
    return int(q)


# -- secrets --------------------------------------------------------------------------------
def test_no_secret_value_is_written_in_the_manifests(objects: list[dict[str, Any]]) -> None:
    assert not of_kind(objects, "Secret"), "Secrets are created apart (secret.example.yaml)"
    for o in objects:
        spec = o.get("spec", {}).get("template", {}).get("spec", {})
        for c in spec.get("containers", []):
            for e in c.get("env", []):
                if SECRET_ENV.search(e["name"]):
                    value = e.get("value")
                    # a value may only compose other variables, e.g. fleet:$(FLOWER_PASSWORD)
                    ok = "secretKeyRef" in e.get("valueFrom", {}) or (
                        value is not None and re.fullmatch(r"[\w.-]*:?\$\(\w+\)", value)
                    )
                    assert ok, (o["metadata"]["name"], e)
            # Kubernetes expands $(VAR) in command and args: a secret there reaches `ps`.
            assert "$(" not in json.dumps([c.get("command"), c.get("args")]), c["name"]


def test_the_example_secret_holds_only_placeholders() -> None:
    secret = yaml.safe_load((K8S / "secret.example.yaml").read_text())
    assert secret["kind"] == "Secret"
    kubernetes_validate.validate(secret, KUBERNETES_VERSION, strict=True)
    assert set(secret["stringData"].values()) == {"CHANGE-ME"}
    # every key a manifest reads exists in the example
    used = set()
    for overlay in OVERLAYS:
        text = json.dumps(render(overlay))
        used |= set(re.findall(r'"key": "([\w-]+)"', text))
    assert used == set(secret["stringData"])


# -- Redis ----------------------------------------------------------------------------------
def redis_script(objs: list[dict[str, Any]]) -> str:
    c = container(of_kind(objs, "StatefulSet")["redis"])
    assert c["command"] == ["sh", "-c"]
    return c["args"][0]


def test_redis_users_have_exactly_the_rules_of_shared_acl(objects: list[dict[str, Any]]) -> None:
    role_of = {
        "default": "admin",
        "producer": "producer",
        "worker": "worker",
        "operator": "operator",
    }
    lines = [ln.split() for ln in redis_script(objects).splitlines()]
    users = [u for u in lines if u and u[0] == "user"]
    assert sorted(u[1] for u in users) == sorted(role_of)
    for user in users:
        name, on, password, *rule = user[1:]
        assert on == "on" and re.fullmatch(r">\$\{FLEET_REDIS_[A-Z]+_PASSWORD\}", password)
        assert rule == rules(role_of[name], 0, (7, 4)), name


def test_redis_persists_refuses_to_evict_and_notifies_as_compose(
    objects: list[dict[str, Any]],
) -> None:
    script = redis_script(objects)
    server = next(ln for ln in script.splitlines() if "redis-server" in ln).split()
    compose = yaml.safe_load((REPO / "compose.yaml").read_text())["services"]["redis"]
    compose_server = next(ln for ln in compose["command"][0].splitlines() if "redis-server" in ln)

    def flag(argv: list[str], name: str) -> str:
        return argv[argv.index(name) + 1]

    assert flag(server, "--appendonly") == "yes"
    assert flag(server, "--maxmemory-policy") == "noeviction"
    notify = flag(compose_server.split(), "--notify-keyspace-events")
    assert flag(server, "--notify-keyspace-events") == notify
    sts = of_kind(objects, "StatefulSet")["redis"]["spec"]
    (claim,) = sts["volumeClaimTemplates"]
    mounts = {v["name"]: v["mountPath"] for v in container({"spec": sts})["volumeMounts"]}
    assert mounts[claim["metadata"]["name"]] == flag(server, "--dir")  # the AOF is on the PVC


def _matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def test_only_fleet_pods_reach_redis(objects: list[dict[str, Any]]) -> None:
    redis_labels = of_kind(objects, "StatefulSet")["redis"]["spec"]["template"]["metadata"][
        "labels"
    ]
    policies = [
        p
        for p in of_kind(objects, "NetworkPolicy").values()
        if _matches(p["spec"]["podSelector"].get("matchLabels", {}), redis_labels)
    ]
    assert policies, "no NetworkPolicy selects the Redis pod"
    pods = {
        name: d["spec"]["template"]["metadata"]["labels"]
        for name, d in of_kind(objects, "Deployment").items()
    }
    fleet = {"gateway", "flower", "exporter", *(f"worker-{m}" for m in MODALITIES)}
    for p in policies:
        assert "Ingress" in p["spec"]["policyTypes"]
        for rule in p["spec"]["ingress"]:
            assert [port["port"] for port in rule["ports"]] == [6379]
            for peer in rule["from"]:
                # a pod selector alone: this namespace's pods, no other namespace or CIDR
                assert set(peer) == {"podSelector"}, peer
                sel = peer["podSelector"]["matchLabels"]
                reach = {n for n, labels in pods.items() if _matches(sel, labels)}
                assert reach == fleet, reach


# -- KEDA -----------------------------------------------------------------------------------
def test_each_modality_scales_on_its_demand_with_a_measured_target(
    objects: list[dict[str, Any]],
) -> None:
    scaled = of_kind(objects, "ScaledObject")
    auths = of_kind(objects, "TriggerAuthentication")
    cold_max_s = max(v["cold_start_s"] for v in MEASURED["modalities"].values())
    for m in MODALITIES:
        spec = scaled[f"worker-{m}"]["spec"]
        assert spec["scaleTargetRef"]["name"] == f"worker-{m}"
        (trigger,) = spec["triggers"]
        meta = trigger["metadata"]
        assert trigger["type"] == "prometheus"
        assert meta["query"] == f'sum(fleet_queue_demand{{queue="{m}"}})'
        assert meta["ignoreNullValues"] == "false"  # a lost exporter is not a demand of 0
        # the measured rate x the drain target, at least one full batch of this overlay's config
        rate = MEASURED["modalities"][m]["rate_per_s"]
        batch = pod_settings(container(workers(objects)[m])).modality(m).batching.max_batch_size
        want = max(math.floor(rate * MEASURED["drain_target_s"]), batch)
        assert float(meta["threshold"]) == want, (m, meta["threshold"], want)
        assert spec["minReplicaCount"] >= 1, m  # interactive: the gateway needs a live worker
        assert spec["cooldownPeriod"] > cold_max_s
        down = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"]
        assert down["stabilizationWindowSeconds"] > cold_max_s
        assert trigger["authenticationRef"]["name"] in auths


# -- commands -------------------------------------------------------------------------------
def fleet_commands(objs: list[dict[str, Any]]) -> dict[str, list[str]]:
    """The `fleet` argv of every container that runs the image's entrypoint (no command)."""
    out = {}
    for o in objs:
        for c in o.get("spec", {}).get("template", {}).get("spec", {}).get("containers", []):
            if c["image"].startswith("mmfleet") and "command" not in c:
                out[o["metadata"]["name"]] = c["args"]
    return out


def test_every_fleet_command_and_option_exists() -> None:
    """Each container's `fleet ...` argv parses (`--help` after it: nothing runs)."""
    from typer.testing import CliRunner

    from producer.cli import app

    commands = fleet_commands(render("cpu"))
    assert {"gateway", "exporter", *(f"worker-{m}" for m in MODALITIES)} <= set(commands)
    runner = CliRunner()
    missing = []
    for name, args in commands.items():
        res = runner.invoke(app, [*args, "--help"])
        if res.exit_code != 0 and f"No such command '{args[0]}'" in res.output:
            missing.append(args[0])
            continue
        assert res.exit_code == 0, (name, args, res.output)
    # `fleet exporter` comes with the observability work; until it is merged, say so.
    if missing:
        assert missing == ["exporter"], missing
        pytest.skip("`fleet exporter` is not in this build: its argv is unchecked")


# -- two models of one modality (overlays/cpu-two-text-models) ------------------------------
def test_two_text_models_each_scale_on_their_own_demand() -> None:
    """The example of several models per modality: MiniLM and "bge" each have a Deployment
    (disjoint pods), a ScaledObject on that model's demand, and every process that routes
    text (the workers, the gateway, the exporter) knows both models."""
    from shared.model_routes import catalog, worker_models

    objs = render("cpu-two-text-models")
    for o in objs:
        if o["kind"] not in KEDA_KINDS:
            kubernetes_validate.validate(o, KUBERNETES_VERSION, strict=True)
        assert o["kind"] == "Namespace" or o["metadata"].get("namespace") == "mmfleet"
    schema = json.loads((Path(__file__).parent / "keda_schema.json").read_text())
    deps, scaled = of_kind(objs, "Deployment"), of_kind(objs, "ScaledObject")
    serves = {}
    for name, model in (("worker-text", "minilm"), ("worker-text-bge", "bge")):
        dep = deps[name]
        assert dep["spec"]["selector"]["matchLabels"]["mmfleet.io/model"] == model
        args = container(dep)["args"]
        assert args == ["worker", "text", "--models", model]
        settings = pod_settings(container(dep))
        serves[name] = [m.table for m in worker_models(settings, "text", args[-1])]
        so = scaled[name]
        jsonschema.validate(so, {**schema, "$ref": "#/$defs/ScaledObject"})
        assert so["spec"]["scaleTargetRef"]["name"] == name
        (trigger,) = so["spec"]["triggers"]
        assert trigger["metadata"]["query"] == f'sum(fleet_queue_demand{{model="{model}"}})'
    assert serves == {"worker-text": ["minilm"], "worker-text-bge": ["bge"]}
    for name in ("gateway", "exporter"):
        settings = pod_settings(container(deps[name]))
        assert [m.table for m in catalog(settings, "text")] == ["minilm", "bge"], name
