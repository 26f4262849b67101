# One image for every Sagaline process: the coordinator, each participant service,
# the dashboard and the scripted agent. docker-compose.yml picks the command.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY schemas ./schemas
COPY participants ./participants
COPY coordinator ./coordinator
COPY services ./services
RUN pip install --no-cache-dir . \
    && useradd --create-home sagaline && mkdir -p /data && chown sagaline /data
USER sagaline
ENV SAGALINE_STATE_DIR=/data
ENTRYPOINT ["sagaline"]
