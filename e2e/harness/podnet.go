package harness

import (
	"fmt"
	"io"
	"net"
	"os"
	goruntime "runtime"
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

// podNetwork is a pod's own network namespace, as its sandbox has: the
// loopback interface up, and the API server reachable at the address the
// kubelet names it by (KUBERNETES_SERVICE_HOST/PORT), forwarded to where it
// listens on this machine's loopback, as kube-proxy forwards the
// `kubernetes` Service. Two plugin pods can then serve the chart's HTTP port
// each, as on two real nodes.
type podNetwork struct {
	ns *os.File
	ln net.Listener

	once sync.Once
}

// newPodNetwork makes the namespace and listens in it on apiAddr
// (127.0.0.1:<port>), forwarding each connection to apiAddr here.
func newPodNetwork(apiAddr string) (*podNetwork, error) {
	p := &podNetwork{}
	errc := make(chan error, 1)
	go func() {
		// The namespace is entered on this thread only. If switching back
		// fails the thread stays locked and exits with the goroutine.
		goruntime.LockOSThread()
		orig, err := os.Open("/proc/thread-self/ns/net")
		if err != nil {
			errc <- err
			return
		}
		defer orig.Close()
		if err := unix.Unshare(unix.CLONE_NEWNET); err != nil {
			errc <- fmt.Errorf("new network namespace: %w", err)
			return
		}
		p.ns, err = os.Open("/proc/thread-self/ns/net")
		if err == nil {
			err = loopbackUp()
		}
		if err == nil {
			// The socket belongs to the namespace it was made in.
			p.ln, err = net.Listen("tcp", apiAddr)
		}
		if unix.Setns(int(orig.Fd()), unix.CLONE_NEWNET) == nil {
			goruntime.UnlockOSThread()
		}
		errc <- err
	}()
	if err := <-errc; err != nil {
		p.close()
		return nil, err
	}
	go p.forward(apiAddr)
	return p, nil
}

// dial connects to addr from inside the pod's network namespace (as the
// kubelet's probes reach a pod's address).
func (p *podNetwork) dial(network, addr string, timeout time.Duration) (net.Conn, error) {
	type result struct {
		conn net.Conn
		err  error
	}
	done := make(chan result, 1)
	go func() {
		goruntime.LockOSThread()
		orig, err := os.Open("/proc/thread-self/ns/net")
		if err != nil {
			done <- result{nil, err}
			return
		}
		defer orig.Close()
		if err := unix.Setns(int(p.ns.Fd()), unix.CLONE_NEWNET); err != nil {
			done <- result{nil, err}
			return
		}
		// The socket belongs to the namespace it was made in.
		conn, err := net.DialTimeout(network, addr, timeout)
		if unix.Setns(int(orig.Fd()), unix.CLONE_NEWNET) == nil {
			goruntime.UnlockOSThread()
		}
		done <- result{conn, err}
	}()
	r := <-done
	return r.conn, r.err
}

// path names the namespace for runc while the harness holds it open.
func (p *podNetwork) path() string {
	return fmt.Sprintf("/proc/%d/fd/%d", os.Getpid(), p.ns.Fd())
}

func (p *podNetwork) forward(to string) {
	for {
		in, err := p.ln.Accept()
		if err != nil {
			return
		}
		go func() {
			defer in.Close()
			out, err := net.Dial("tcp", to)
			if err != nil {
				return
			}
			defer out.Close()
			done := make(chan struct{})
			go func() { _, _ = io.Copy(out, in); close(done) }()
			_, _ = io.Copy(in, out)
			<-done
		}()
	}
}

func (p *podNetwork) close() {
	p.once.Do(func() {
		if p.ln != nil {
			p.ln.Close()
		}
		if p.ns != nil {
			p.ns.Close()
		}
	})
}

// loopbackUp sets the `lo` interface of the current thread's network
// namespace up.
func loopbackUp() error {
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	ifr, err := unix.NewIfreq("lo")
	if err != nil {
		return err
	}
	if err := unix.IoctlIfreq(fd, unix.SIOCGIFFLAGS, ifr); err != nil {
		return fmt.Errorf("lo flags: %w", err)
	}
	ifr.SetUint16(ifr.Uint16() | unix.IFF_UP)
	if err := unix.IoctlIfreq(fd, unix.SIOCSIFFLAGS, ifr); err != nil {
		return fmt.Errorf("lo up: %w", err)
	}
	return nil
}
