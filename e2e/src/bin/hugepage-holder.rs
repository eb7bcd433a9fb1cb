//! `hugepage-holder PAGES [SIZE_KB] [--and-one-more] [--hugetlbfs DIR]`: the
//! test image's hugepage consumer.
//!
//! Maps PAGES hugepages of SIZE_KB (default 2048) with MAP_HUGETLB (with
//! `--hugetlbfs DIR`: a file of that many pages in the hugetlbfs mounted at
//! DIR, mapped shared, as DPDK maps its memory; `--hugetlbfs from-env`: the
//! directory the first `HUGEPOOL_HUGETLBFS_*` variable names, a claim's),
//! faults
//! every one in so the kernel counts them in use, prints one line and holds
//! them until SIGTERM or SIGINT, then exits 0. Exits 1 when the kernel (or
//! the pod's hugetlb limit) refuses the mapping, so a pod shows why.
//!
//! With `--and-one-more`, once it holds PAGES a child process (in the same
//! cgroups) maps and faults one page more and the holder prints what became
//! of it: `granted`, `refused by mmap: ...` (a hugetlb reservation limit or
//! an empty pool) or `refused by SIGBUS` (a hugetlb fault limit: the kernel
//! kills the faulting process). The holder itself goes on holding.

use std::process::ExitCode;

fn main() -> ExitCode {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let one_more = args.iter().any(|a| a == "--and-one-more");
    args.retain(|a| a != "--and-one-more");
    let hugetlbfs = match args.iter().position(|a| a == "--hugetlbfs") {
        Some(at) if at + 1 < args.len() => {
            let dir = args.remove(at + 1);
            args.remove(at);
            Some(dir)
        }
        Some(_) => {
            eprintln!("hugepage-holder: --hugetlbfs needs a directory");
            return ExitCode::from(2);
        }
        None => None,
    };
    let hugetlbfs = match hugetlbfs.as_deref() {
        Some("from-env") => {
            match std::env::vars().find(|(k, _)| k.starts_with("HUGEPOOL_HUGETLBFS_")) {
                Some((_, dir)) => Some(dir),
                None => {
                    eprintln!(
                        "hugepage-holder: no HUGEPOOL_HUGETLBFS_ variable (no claim's hugetlbfs)"
                    );
                    return ExitCode::from(2);
                }
            }
        }
        _ => hugetlbfs,
    };
    let dir = hugetlbfs.as_deref();
    if let Some(dir) = dir {
        match fs_pages(dir) {
            Ok((page_kb, total)) => {
                println!("hugepage-holder: hugetlbfs {dir}: {total} pages of {page_kb}kB")
            }
            Err(err) => {
                eprintln!("hugepage-holder: statfs {dir}: {err}");
                return ExitCode::from(1);
            }
        }
    }
    let parsed = match args.as_slice() {
        [pages] => pages.parse::<usize>().map(|p| (p, 2048)),
        [pages, size_kb] => pages
            .parse::<usize>()
            .and_then(|p| size_kb.parse::<usize>().map(|s| (p, s))),
        _ => {
            eprintln!("usage: hugepage-holder PAGES [SIZE_KB] [--and-one-more]");
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
    if let Err(err) = map_and_fault(pages, size_kb, dir) {
        eprintln!("hugepage-holder: mmap of {pages} x {size_kb}kB hugepages failed: {err}");
        return ExitCode::from(1);
    }
    println!("hugepage-holder: holding {pages} x {size_kb}kB hugepages");
    if one_more {
        println!(
            "hugepage-holder: one more page: {}",
            try_one_more(size_kb, dir)
        );
    }
    wait_for_termination();
    println!("hugepage-holder: released");
    ExitCode::SUCCESS
}

/// Maps `pages` hugepages of `size_kb` and faults every one in; the mapping
/// is kept for the life of the process. With `dir`, the pages are a file's
/// in the hugetlbfs mounted there (unlinked once mapped: the mapping keeps
/// them).
fn map_and_fault(pages: usize, size_kb: usize, dir: Option<&str>) -> std::io::Result<()> {
    let page_bytes = size_kb * 1024;
    let (flags, fd) = match dir {
        Some(dir) => {
            let path = std::path::Path::new(dir)
                .join(format!("hugepage-holder-{}-{pages}", std::process::id()));
            let file = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(true)
                .open(&path)?;
            std::fs::remove_file(&path)?;
            // The mapping holds the file open from here on.
            (libc::MAP_SHARED, std::os::fd::IntoRawFd::into_raw_fd(file))
        }
        // MAP_HUGE_SHIFT encodes log2 of the page size in the flags.
        None => (
            libc::MAP_PRIVATE
                | libc::MAP_ANONYMOUS
                | libc::MAP_HUGETLB
                | ((page_bytes.trailing_zeros() as libc::c_int) << libc::MAP_HUGE_SHIFT),
            -1,
        ),
    };
    // SAFETY: a fresh mapping (anonymous, or of a file this process made);
    // only this process touches it.
    let addr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            pages * page_bytes,
            libc::PROT_READ | libc::PROT_WRITE,
            flags,
            fd,
            0,
        )
    };
    if addr == libc::MAP_FAILED {
        return Err(std::io::Error::last_os_error());
    }
    for page in 0..pages {
        // SAFETY: inside the mapping; one byte per page faults it in.
        unsafe { std::ptr::write_volatile(addr.cast::<u8>().add(page * page_bytes), 1) };
    }
    Ok(())
}

/// The page size (kB) and the pages a hugetlbfs at `dir` may hold.
fn fs_pages(dir: &str) -> std::io::Result<(u64, u64)> {
    let path = std::ffi::CString::new(dir).map_err(std::io::Error::other)?;
    // SAFETY: a valid C string and a zeroed struct the call fills.
    let mut fs: libc::statfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statfs(path.as_ptr(), &mut fs) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok((fs.f_bsize as u64 / 1024, fs.f_blocks as u64))
}

/// Maps and faults one page more in a child process and says what became
/// of it. A child, because a hugetlb fault limit answers with SIGBUS.
fn try_one_more(size_kb: usize, dir: Option<&str>) -> String {
    // SAFETY: this process has one thread; the child only maps, writes and
    // exits.
    match unsafe { libc::fork() } {
        -1 => format!("not tried: fork: {}", std::io::Error::last_os_error()),
        0 => {
            // The mmap's errno, if it failed, is the exit status.
            let code = match map_and_fault(1, size_kb, dir) {
                Ok(()) => 0,
                Err(err) => err.raw_os_error().unwrap_or(255).clamp(1, 255),
            };
            // SAFETY: leaves the child without running the parent's exit code.
            unsafe { libc::_exit(code) }
        }
        child => {
            let mut status = 0;
            // SAFETY: waits for the child just forked.
            unsafe { libc::waitpid(child, &mut status, 0) };
            if libc::WIFSIGNALED(status) && libc::WTERMSIG(status) == libc::SIGBUS {
                "refused by SIGBUS".into()
            } else if libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0 {
                "granted".into()
            } else if libc::WIFEXITED(status) {
                let err = std::io::Error::from_raw_os_error(libc::WEXITSTATUS(status));
                format!("refused by mmap: {err}")
            } else {
                format!("the child ended with wait status {status}")
            }
        }
    }
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
