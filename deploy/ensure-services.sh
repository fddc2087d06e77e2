#!/usr/bin/env bash
# Make sure Redis and RabbitMQ answer. Where one is installed here but down, start it; where it is
# missing, say exactly what is missing and how to start it. Never fall back to a fake.
set -u

redis_url=${RUNBRAKE_REDIS_URL:-redis://127.0.0.1:6379/0}
amqp_url=${RUNBRAKE_RABBITMQ_URL:-amqp://guest:guest@127.0.0.1:5672/}

host_port() {  # scheme://[user:pass@]host[:port][/...] -> "host port"
    local rest=${1#*://}; rest=${rest#*@}; rest=${rest%%/*}
    local host=${rest%:*} port=${rest##*:}
    [ "$host" = "$rest" ] && port=$2
    echo "$host $port"
}

answers() { timeout 2 bash -c "exec 3<>/dev/tcp/$1/$2" 2>/dev/null; }

wait_for() {  # name host port seconds
    local i
    for ((i = 0; i < $4 * 10; i++)); do answers "$2" "$3" && return 0; sleep 0.1; done
    return 1
}

compose_hint="or run both in containers: docker compose -f deploy/compose.yaml up -d"
missing=0

read -r rhost rport <<<"$(host_port "$redis_url" 6379)"
if answers "$rhost" "$rport"; then
    echo "redis: answering at $rhost:$rport"
elif [ "$rhost" = "127.0.0.1" ] && command -v redis-server >/dev/null; then
    echo "redis: not answering at $rhost:$rport; starting the local redis-server"
    mkdir -p /var/lib/redis /var/log/redis 2>/dev/null
    redis-server --daemonize yes --bind 127.0.0.1 -::1 --port "$rport" --save "" --appendonly no \
        --dir /var/lib/redis --logfile /var/log/redis/ci.log
    wait_for redis "$rhost" "$rport" 20 || { echo "redis: started but not answering; see /var/log/redis/ci.log" >&2; missing=1; }
elif [ "$rhost" != "127.0.0.1" ]; then
    echo "redis: nothing answers at $rhost:$rport (RUNBRAKE_REDIS_URL); start it there, or unset the variable to use a local one" >&2
    missing=1
else
    echo "redis: nothing answers at $rhost:$rport and redis-server is not installed here." >&2
    echo "       install it (apt-get install redis-server) and start it:" >&2
    echo "       redis-server --daemonize yes --bind 127.0.0.1 --port $rport --save '' --appendonly no" >&2
    echo "       $compose_hint" >&2
    missing=1
fi

read -r ahost aport <<<"$(host_port "$amqp_url" 5672)"
if answers "$ahost" "$aport" && { ! command -v rabbitmq-diagnostics >/dev/null || rabbitmq-diagnostics -q ping >/dev/null 2>&1 || [ "$ahost" != "127.0.0.1" ]; }; then
    echo "rabbitmq: answering at $ahost:$aport"
elif [ "$ahost" = "127.0.0.1" ] && command -v rabbitmq-server >/dev/null; then
    echo "rabbitmq: not answering at $ahost:$aport; starting the local rabbitmq-server"
    rabbitmq-server -detached
    timeout 120 rabbitmqctl await_startup >/dev/null 2>&1 || timeout 60 bash -c 'until rabbitmq-diagnostics -q ping >/dev/null 2>&1; do sleep 1; done'
    wait_for rabbitmq "$ahost" "$aport" 30 || { echo "rabbitmq: started but not answering on $aport" >&2; missing=1; }
elif [ "$ahost" != "127.0.0.1" ]; then
    echo "rabbitmq: nothing answers at $ahost:$aport (RUNBRAKE_RABBITMQ_URL); start it there, or unset the variable to use a local one" >&2
    missing=1
else
    echo "rabbitmq: nothing answers at $ahost:$aport and rabbitmq-server is not installed here." >&2
    echo "          install it (apt-get install rabbitmq-server) and start it: rabbitmq-server -detached" >&2
    echo "          $compose_hint" >&2
    missing=1
fi

if [ "$missing" -ne 0 ]; then
    echo "runbrake needs a real Redis and a real RabbitMQ; there is no fake to fall back to." >&2
    exit 1
fi
