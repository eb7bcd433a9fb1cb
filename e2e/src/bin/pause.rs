//! `pause`: the pod sandbox process of the test node's containerd, built
//! here because no registry is reachable. Like the upstream pause
//! container it waits, reaps children, and exits 0 on SIGTERM or SIGINT.

fn main() {
    // SAFETY: plain signal-mask and wait calls on values we own.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        for signal in [libc::SIGTERM, libc::SIGINT, libc::SIGCHLD] {
            libc::sigaddset(&mut set, signal);
        }
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        loop {
            let mut signal = 0;
            libc::sigwait(&set, &mut signal);
            if signal == libc::SIGCHLD {
                while libc::waitpid(-1, std::ptr::null_mut(), libc::WNOHANG) > 0 {}
            } else {
                return;
            }
        }
    }
}
