import java.io.BufferedReader;
import java.io.FileOutputStream;
import java.io.IOException;
import java.io.InputStreamReader;
import java.nio.charset.StandardCharsets;
import java.util.concurrent.TimeUnit;

import org.apache.curator.framework.CuratorFramework;
import org.apache.curator.framework.CuratorFrameworkFactory;
import org.apache.curator.framework.recipes.leader.LeaderLatch;
import org.apache.curator.framework.recipes.locks.InterProcessLock;
import org.apache.curator.framework.recipes.locks.InterProcessMutex;
import org.apache.curator.framework.recipes.locks.InterProcessReadWriteLock;
import org.apache.curator.retry.ExponentialBackoffRetry;
import org.apache.zookeeper.data.Stat;

/**
 * Contends for a lock with Apache Curator's own recipes, so celery-zklock's Python locks can be
 * checked against the reference implementation on the same ZooKeeper path.
 *
 * <pre>
 * CuratorContender &lt;hosts&gt; &lt;lock-path&gt; &lt;mutex|read|write|latch&gt; &lt;iterations&gt;
 *                  &lt;hold-ms&gt;
 *                  &lt;witness-file&gt; &lt;holder-prefix&gt;
 * </pre>
 *
 * Prints {@code ready} once connected, then waits for one line (or end of file) on standard
 * input, so a test can start several contenders together. Each iteration i acquires, appends
 * {@code enter <prefix>-<i> <read|write>} to the witness file, sleeps hold-ms, appends
 * {@code exit ...} and releases. A negative hold-ms holds until the next line (or end of file)
 * on standard input instead, so a test can look at the lock while it is held for sure. A mutex records mode {@code write}. Each witness line is one
 * write() on a stream opened in append mode (O_APPEND), as the witness format requires.
 *
 * <p>{@code latch} contends with Curator's {@code LeaderLatch} instead (participant id: the
 * holder prefix): each iteration starts a new latch, awaits leadership, records the section
 * while it leads (mode {@code write}) and closes the latch, which gives up the leadership. Its
 * holder ids are {@code <prefix>-<i>@<czxid>}, the czxid of the latch's node (its place in the
 * election's queue: nodes are created in czxid order).
 *
 * Exit status: 0 done, 1 unexpected error, 2 usage, 3 could not connect, 4 an acquire timed out.
 * The acquire timeout is 60 s unless -Dcontender.acquireTimeoutMs says otherwise.
 */
public final class CuratorContender {
    private static final int SESSION_TIMEOUT_MS = 10_000;
    private static final int CONNECTION_TIMEOUT_MS = 15_000;
    private static final long CONNECT_WAIT_S = 30;

    private static final BufferedReader STDIN =
            new BufferedReader(new InputStreamReader(System.in, StandardCharsets.UTF_8));

    private CuratorContender() {}

    public static void main(String[] args) throws Exception {
        if (args.length != 7) {
            System.err.println("usage: CuratorContender <hosts> <lock-path> <mutex|read|write|latch>"
                    + " <iterations> <hold-ms> <witness-file> <holder-prefix>");
            System.exit(2);
        }
        String hosts = args[0];
        String lockPath = args[1];
        String kind = args[2];
        int iterations = Integer.parseInt(args[3]);
        long holdMs = Long.parseLong(args[4]);
        String witnessFile = args[5];
        String prefix = args[6];
        long acquireTimeoutMs = Long.getLong("contender.acquireTimeoutMs", 60_000L);
        if (!kind.equals("mutex") && !kind.equals("read") && !kind.equals("write")
                && !kind.equals("latch")) {
            System.err.println("lock kind must be mutex, read, write or latch, not " + kind);
            System.exit(2);
        }
        String mode = kind.equals("read") ? "read" : "write";

        CuratorFramework client = CuratorFrameworkFactory.newClient(
                hosts, SESSION_TIMEOUT_MS, CONNECTION_TIMEOUT_MS,
                new ExponentialBackoffRetry(100, 5));
        int status;
        try (FileOutputStream witness = new FileOutputStream(witnessFile, true)) {
            client.start();
            if (!client.blockUntilConnected((int) CONNECT_WAIT_S, TimeUnit.SECONDS)) {
                System.err.println("could not connect to " + hosts);
                System.exit(3);
            }
            System.out.println("ready");
            System.out.flush();
            awaitGo();
            status = contend(lockFor(client, lockPath, kind, prefix), iterations, holdMs,
                    acquireTimeoutMs,
                    witness, prefix, mode);
        } finally {
            client.close();
        }
        System.exit(status);
    }

    private static InterProcessLock lockFor(CuratorFramework client, String path, String kind,
            String id) {
        switch (kind) {
            case "latch":
                return new LatchTerms(client, path, id);
            case "read":
                return new InterProcessReadWriteLock(client, path).readLock();
            case "write":
                return new InterProcessReadWriteLock(client, path).writeLock();
            default:
                return new InterProcessMutex(client, path);
        }
    }

    private static int contend(InterProcessLock lock, int iterations, long holdMs,
            long acquireTimeoutMs, FileOutputStream witness, String prefix, String mode)
            throws Exception {
        for (int i = 0; i < iterations; i++) {
            String holder = prefix + "-" + i;
            if (!lock.acquire(acquireTimeoutMs, TimeUnit.MILLISECONDS)) {
                System.err.println(holder + ": acquire timed out after " + acquireTimeoutMs + " ms");
                return 4;
            }
            try {
                if (lock instanceof LatchTerms) {
                    holder += "@" + ((LatchTerms) lock).czxid();
                }
                record(witness, "enter", holder, mode);
                if (holdMs < 0) {
                    STDIN.readLine();
                } else if (holdMs > 0) {
                    Thread.sleep(holdMs);
                }
                record(witness, "exit", holder, mode);
            } finally {
                lock.release();
            }
        }
        return 0;
    }

    private static void record(FileOutputStream witness, String kind, String holder, String mode)
            throws IOException {
        // One write(byte[]) is one write() system call for a line this short.
        witness.write((kind + " " + holder + " " + mode + "\n").getBytes(StandardCharsets.UTF_8));
    }

    /** Leadership terms as a lock: acquire starts a LeaderLatch and awaits it, release closes it. */
    private static final class LatchTerms implements InterProcessLock {
        private final CuratorFramework client;
        private final String path;
        private final String id;
        private LeaderLatch latch;

        LatchTerms(CuratorFramework client, String path, String id) {
            this.client = client;
            this.path = path;
            this.id = id;
        }

        @Override
        public void acquire() throws Exception {
            if (!acquire(Long.MAX_VALUE, TimeUnit.MILLISECONDS)) {
                throw new IllegalStateException("not elected");
            }
        }

        @Override
        public boolean acquire(long time, TimeUnit unit) throws Exception {
            LeaderLatch started = new LeaderLatch(client, path, id);
            started.start();
            if (started.await(time, unit)) {
                latch = started;
                return true;
            }
            started.close();
            return false;
        }

        /** The czxid of the node this term leads with, read from ZooKeeper while it leads. */
        long czxid() throws Exception {
            String node = latch.getOurPath();
            Stat stat = node == null ? null : client.checkExists().forPath(node);
            if (stat == null) {
                throw new IllegalStateException("leading without a node: " + node);
            }
            return stat.getCzxid();
        }

        @Override
        public void release() throws Exception {
            LeaderLatch held = latch;
            latch = null;
            if (held != null) {
                held.close();
            }
        }

        @Override
        public boolean isAcquiredInThisProcess() {
            return latch != null && latch.hasLeadership();
        }
    }

    private static void awaitGo() throws IOException {
        STDIN.readLine(); // a line or end of file: either way, go
    }
}
