"""The one layer that talks to Kafka.

Everything above it (coordinator, participants, operator tools, services) gets its
producers, consumers and admin clients here, writes the ledger through
:class:`LedgerWriter` (each record acknowledged), dead-letters through
:class:`DeadLetterWriter`, reads through :class:`LedgerReader`, and creates topics
with :func:`ensure_topics`. Client settings come from the environment
(``KAFKA_BOOTSTRAP_SERVERS``, ``SAGALINE_KAFKA_*``, ``SAGALINE_KAFKA_PROPERTIES_FILE``),
so SASL or SSL reach every client without code changes.

Example::

    from sagaline.kafka import LedgerWriter, ensure_topics, require_bootstrap

    bootstrap = require_bootstrap(settings, "my-service")
    ensure_topics(bootstrap, settings.topics, ["payments"], settings.partitions,
                  replication=settings.replication)
    ledger = LedgerWriter(bootstrap, settings.topics, settings.signer())
    ledger.append(record)

Kafka's own types (``Message``, ``TopicPartition``...) are re-exported so the layers
above never import the client library themselves.
"""

from confluent_kafka import (
    OFFSET_BEGINNING,
    Consumer,
    KafkaError,
    KafkaException,
    Message,
    Producer,
    TopicPartition,
)
from confluent_kafka.admin import AdminClient

from sagaline.kafka._claims import InstanceClaimed
from sagaline.kafka._clients import (
    BrokerNotConfigured,
    BrokerUnreachable,
    closing_tolerated,
    configured_broker,
    create_admin,
    create_consumer,
    create_producer,
    create_uncommitted_reader,
    raise_if_fatal,
    require_bootstrap,
    require_broker_answers,
    watermarks,
)
from sagaline.kafka._config import (
    ClientConfig,
    KafkaConfigError,
    consumer_config,
    producer_config,
    redacted,
)
from sagaline.kafka._groups import GroupInfo, GroupNotAuthorized, describe_group
from sagaline.kafka._headers import headers_of, readable_headers
from sagaline.kafka._reader import LedgerReader, TopicMissing, TopicNotAuthorized, read_to_end
from sagaline.kafka._topics import TopicSetupError, ensure_topics
from sagaline.kafka._writers import (
    DeadLetterWriter,
    DeliveryFailed,
    LedgerWriter,
    RecordTooLarge,
    deliver,
)

__all__ = [
    "OFFSET_BEGINNING",
    "AdminClient",
    "BrokerNotConfigured",
    "BrokerUnreachable",
    "ClientConfig",
    "Consumer",
    "DeadLetterWriter",
    "DeliveryFailed",
    "GroupInfo",
    "GroupNotAuthorized",
    "InstanceClaimed",
    "KafkaConfigError",
    "KafkaError",
    "KafkaException",
    "LedgerReader",
    "LedgerWriter",
    "Message",
    "Producer",
    "RecordTooLarge",
    "TopicMissing",
    "TopicNotAuthorized",
    "TopicPartition",
    "TopicSetupError",
    "closing_tolerated",
    "configured_broker",
    "consumer_config",
    "create_admin",
    "create_consumer",
    "create_producer",
    "create_uncommitted_reader",
    "deliver",
    "describe_group",
    "ensure_topics",
    "headers_of",
    "producer_config",
    "raise_if_fatal",
    "read_to_end",
    "readable_headers",
    "redacted",
    "require_bootstrap",
    "require_broker_answers",
    "watermarks",
]
