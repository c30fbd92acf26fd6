# The operator image: kopf, the Kubernetes client and the controller. No torch and no GPU: runs
# happen in Jobs on the run image (bench/Dockerfile). bench/ is here because a new lab repo is
# seeded from it (autolab init's code), and git because the lab repo is a git repository.
#   docker build -t autolab-operator .
FROM python:3.11-slim

RUN apt-get update \
 && apt-get install -y --no-install-recommends git \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --uid 10001 --user-group --create-home autolab

WORKDIR /opt/autolab
# Only what the operator imports; the package itself goes in without its dependency list,
# which names torch for the local backend.
RUN pip install --no-cache-dir "kopf>=1.45" "kubernetes>=29" "pyyaml>=6" "jsonschema>=4.20" \
        "filelock>=3.12"
COPY pyproject.toml README.md ./
COPY controller/ controller/
COPY bench/ bench/
COPY research/templates/ research/templates/
RUN pip install --no-cache-dir --no-deps -e . \
 && python -c "import controller.cli.operator, controller.operator, kopf, kubernetes"

USER 10001
ENV PYTHONUNBUFFERED=1 \
    AUTOLAB_LAB_DIR=/var/lib/autolab
EXPOSE 8080
# The operator's own entry point (kopf underneath, the handlers registered explicitly); flags
# (namespace, peering, liveness) come from the Deployment's args (manifests/operator.yaml).
# `autolab operator` takes the same flags.
ENTRYPOINT ["python", "-m", "controller.cli.operator"]
CMD ["--namespace=autolab", "--peering=autolab", "--liveness=http://0.0.0.0:8080/healthz"]
