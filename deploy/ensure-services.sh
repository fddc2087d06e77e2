#!/usr/bin/env bash
# Make sure Redis and RabbitMQ answer. Where one is installed here but down, start it; where it is
# missing, say exactly what is missing and how to start it. Never fall back to a fake.
set -u

host_port() {  # scheme://[user:pass@]host[:port][/...] default-port -> "host port"
    local rest=${1#*://}; rest=${rest#*@}; rest=${rest%%/*}
    local host=${rest%:*} port=${rest##*:}
    [ "$host" = "$rest" ] && port=$2
    echo "$host $port"
}

answers() { timeout 2 bash -c "exec 3<>/dev/tcp/$1/$2" 2>/dev/null; }

wait_for() {  # host port seconds
    local i
    for ((i = 0; i < $3 * 10; i++)); do answers "$1" "$2" && return 0; sleep 0.1; done
    return 1
}

start_redis() {
    mkdir -p /var/lib/redis /var/log/redis 2>/dev/null
    redis-server --daemonize yes --bind 127.0.0.1 -::1 --port "$1" --save "" --appendonly no \
        --dir /var/lib/redis --logfile /var/log/redis/ci.log
}

start_rabbitmq() {
    rabbitmq-server -detached
    timeout 120 rabbitmqctl await_startup >/dev/null 2>&1 ||
        timeout 60 bash -c 'until rabbitmq-diagnostics -q ping >/dev/null 2>&1; do sleep 1; done'
}

# ensure NAME URL DEFAULT_PORT VARIABLE SERVER_BINARY START_FUNCTION HOW_TO_START
ensure() {
    local name=$1 url=$2 variable=$4 binary=$5 start=$6 how=$7 host port
    read -r host port <<<"$(host_port "$url" "$3")"
    if answers "$host" "$port"; then
        echo "$name: answering at $host:$port"
    elif [ "$host" != "127.0.0.1" ]; then
        echo "$name: nothing answers at $host:$port ($variable); start it there, or unset the variable to use a local one" >&2
        return 1
    elif command -v "$binary" >/dev/null; then
        echo "$name: not answering at $host:$port; starting the local $binary"
        "$start" "$port"
        wait_for "$host" "$port" 30 || { echo "$name: started but not answering on $port" >&2; return 1; }
    else
        echo "$name: nothing answers at $host:$port and $binary is not installed here." >&2
        echo "       install it (apt-get install $binary) and start it: $how" >&2
        echo "       or run both in containers: docker compose -f deploy/compose.yaml up -d" >&2
        return 1
    fi
}

missing=0
ensure redis "${RUNBRAKE_REDIS_URL:-redis://127.0.0.1:6379/0}" 6379 RUNBRAKE_REDIS_URL redis-server start_redis \
    "redis-server --daemonize yes --bind 127.0.0.1 --save '' --appendonly no" || missing=1
ensure rabbitmq "${RUNBRAKE_RABBITMQ_URL:-amqp://guest:guest@127.0.0.1:5672/}" 5672 RUNBRAKE_RABBITMQ_URL \
    rabbitmq-server start_rabbitmq "rabbitmq-server -detached" || missing=1

if [ "$missing" -ne 0 ]; then
    echo "runbrake needs a real Redis and a real RabbitMQ; there is no fake to fall back to." >&2
    exit 1
fi
