//! `hugepage-holder PAGES [SIZE_KB]`: the test image's hugepage consumer.
//!
//! Maps PAGES hugepages of SIZE_KB (default 2048) with MAP_HUGETLB, faults
//! every one in so the kernel counts them in use, prints one line and holds
//! them until SIGTERM or SIGINT, then exits 0. Exits 1 when the kernel (or
//! the pod's hugetlb limit) refuses the mapping, so a pod shows why.

use std::process::ExitCode;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let parsed = match args.as_slice() {
        [pages] => pages.parse::<usize>().map(|p| (p, 2048)),
        [pages, size_kb] => pages
            .parse::<usize>()
            .and_then(|p| size_kb.parse::<usize>().map(|s| (p, s))),
        _ => {
            eprintln!("usage: hugepage-holder PAGES [SIZE_KB]");
            return ExitCode::from(2);
        }
    };
    let Ok((pages, size_kb)) = parsed else {
        eprintln!("hugepage-holder: PAGES and SIZE_KB must be whole numbers, got {args:?}");
        return ExitCode::from(2);
    };
    if !size_kb.is_power_of_two() || pages == 0 {
        eprintln!("hugepage-holder: need PAGES >= 1 and SIZE_KB a power of two");
        return ExitCode::from(2);
    }
    let page_bytes = size_kb * 1024;
    // MAP_HUGE_SHIFT encodes log2 of the page size in the flags.
    let size_flag = (page_bytes.trailing_zeros() as libc::c_int) << libc::MAP_HUGE_SHIFT;
    let len = pages * page_bytes;
    // SAFETY: a fresh anonymous mapping; only this process touches it.
    let addr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_HUGETLB | size_flag,
            -1,
            0,
        )
    };
    if addr == libc::MAP_FAILED {
        eprintln!(
            "hugepage-holder: mmap of {pages} x {size_kb}kB hugepages failed: {}",
            std::io::Error::last_os_error()
        );
        return ExitCode::from(1);
    }
    for page in 0..pages {
        // SAFETY: inside the mapping; one byte per page faults it in.
        unsafe { std::ptr::write_volatile(addr.cast::<u8>().add(page * page_bytes), 1) };
    }
    println!("hugepage-holder: holding {pages} x {size_kb}kB hugepages");
    wait_for_termination();
    println!("hugepage-holder: released");
    ExitCode::SUCCESS
}

/// Blocks until SIGTERM or SIGINT arrives.
fn wait_for_termination() {
    // SAFETY: plain signal-mask calls on a set we own.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGTERM);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        let mut signal = 0;
        libc::sigwait(&set, &mut signal);
    }
}
