# One image for every Sagaline process: the coordinator, each participant service,
# the dashboard and the scripted agent. docker-compose.yml picks the command.
FROM python:3.11-slim
WORKDIR /app

# Dependencies first, in their own layer: it is rebuilt only when pyproject.toml
# changes, not on every code change.
COPY pyproject.toml ./
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" > /tmp/requirements.txt \
    && pip install --no-cache-dir -r /tmp/requirements.txt \
    && useradd --create-home sagaline && mkdir -p /data && chown sagaline /data

# Then the code (every package setuptools ships), installed without touching deps.
COPY README.md ./
COPY schemas ./schemas
COPY sagaline ./sagaline
COPY participants ./participants
COPY coordinator ./coordinator
COPY services ./services
RUN pip install --no-cache-dir --no-deps .

USER sagaline
ENV SAGALINE_STATE_DIR=/data
ENTRYPOINT ["sagaline"]
